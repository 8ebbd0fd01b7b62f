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
for FORGET_S (gone: the nodes relay only gateways they hear from) is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from pdserve.common.wire.protocol import GatewayLoad
from pdserve.gateway.sizing import Sizing

FORGET_S = 30.0  # a gateway no node has relayed this long is gone: its backlog with it


class OtherGateways:
    def __init__(self, own_id: Callable[[], str], sizing: Sizing) -> None:
        self.own_id = own_id
        self.sizing = sizing
        self.seen: dict[str, tuple[GatewayLoad, float]] = {}  # gateway id -> (load, heard at)

    def relayed(self, loads: tuple[GatewayLoad, ...], now: float) -> None:
        for load in loads:
            if load.gateway == self.own_id():
                continue
            before = self.seen.get(load.gateway)
            if before is not None and load.seq <= before[0].seq:
                continue  # news we have (or older: another node relays less recent news)
            old = before[0] if before is not None else None
            if old is not None:  # what grew since (the first report only sets the base)
                self.sizing.add(max(0, load.prompt_tokens - old.prompt_tokens),
                                load.requests - old.requests,
                                max(0, load.output_tokens - old.output_tokens), now,
                                max(0, load.local_tokens - old.local_tokens))  # fmt: skip
                # a node of an older version relays it without local_tokens (0): the base
                # must not go back, or the next report adds the whole total again
                load = msgspec.structs.replace(
                    load, local_tokens=max(load.local_tokens, old.local_tokens)
                )
            self.seen[load.gateway] = (load, now)

    def waiting_tokens(self, now: float) -> int:
        """Prompt tokens waiting at the other gateways for a prefill node."""
        for gateway, (_, heard) in list(self.seen.items()):
            if now - heard > FORGET_S:
                del self.seen[gateway]
        return sum(load.waiting_tokens for load, _ in self.seen.values())
