"""The other gateways' load as the nodes relay it (several gateways, one cluster), so that
the gateway leading pool care sizes the pools for every gateway's arrivals and waiting
prompts, not for its own share of them (a leader behind a balancer with N gateways saw
about 1/N of the load: docs/architecture.md, "Several gateways").

Each gateway tells the nodes its own load in its heartbeat replies (`HeartbeatReply.load`:
its arrivals since it started, and the prompt tokens waiting there); a node passes on what
each gateway said in its heartbeats to the others (`Load.gateways`). Every gateway adds
what the others' counts grew by to its own sizing rates (any of them may lead next), and
their waiting prompts to its backlog. A report older than one already seen (another node
relays less recent news: each report is numbered) is ignored; a gateway with no new report
for FORGET_S (gone: the nodes relay only gateways they hear from) is forgotten. A report is
a node's word: one with a negative or unbounded count (past 2**53, where a float no longer
holds every integer) is dropped, and counts that go back move nothing, then or later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from pdserve.common.logs import Every, cut
from pdserve.common.wire.protocol import GatewayLoad
from pdserve.gateway.sizing import Sizing

log = logging.getLogger(__name__)
FORGET_S = 30.0  # a gateway no node has relayed this long is gone: its backlog with it
COUNTS = ("prompt_tokens", "requests", "output_tokens", "local_tokens")  # since it started
MOST = 1 << 53  # a count or a backlog past it is no gateway's


class OtherGateways:
    def __init__(self, own_id: Callable[[], str], sizing: Sizing) -> None:
        self.own_id = own_id
        self.sizing = sizing
        self.seen: dict[str, tuple[GatewayLoad, float]] = {}  # gateway id -> (load, heard at)
        self.said = Every(10.0)  # reports dropped: a log line at most every 10 s

    def relayed(self, loads: tuple[GatewayLoad, ...], now: float) -> None:
        for load in loads:
            if load.gateway == self.own_id():
                continue
            if not all(0 <= getattr(load, f) < MOST for f in (*COUNTS, "waiting_tokens")):
                if self.said.due():
                    log.warning("dropping a relayed load of gateway %s: a count outside "
                                "0..2**53", cut(load.gateway))  # fmt: skip
                continue
            before = self.seen.get(load.gateway)
            if before is not None and load.seq <= before[0].seq:
                continue  # news we have (or older: another node relays less recent news)
            old = before[0] if before is not None else None
            if old is not None:  # what grew since (the first report only sets the base)
                grew = [max(0, getattr(load, f) - getattr(old, f)) for f in COUNTS]
                self.sizing.add(grew[0], grew[1], grew[2], now, grew[3])
                # a count that went back (a node of an older version relays local_tokens
                # as 0) keeps its base: else the next report adds the whole total again
                load = msgspec.structs.replace(
                    load, **{f: max(getattr(load, f), getattr(old, f)) for f in COUNTS}
                )
            self.seen[load.gateway] = (load, now)
        self._forget(now)  # here too: a gateway that does not lead never asks waiting_tokens

    def waiting_tokens(self, now: float) -> int:
        """Prompt tokens waiting at the other gateways for a prefill node."""
        self._forget(now)
        return sum(load.waiting_tokens for load, _ in self.seen.values())

    def _forget(self, now: float) -> None:
        """Gateways gone (each restart comes back under a new id): else they add up."""
        for gateway, (_, heard) in list(self.seen.items()):
            if now - heard > FORGET_S:
                del self.seen[gateway]
