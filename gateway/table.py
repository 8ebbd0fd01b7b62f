"""The gateway's one record of where every request runs. Pure: no sockets, `now` passed in.

Each placement attempt of a request is an `Attempt`, keyed by its wire id
(`request_id.attempt`): the prefill node that accepted it, the decode node its KV goes to, the
KV blocks promised there, and its phase. Nothing else keeps placement state: what policies,
metrics and failure handling need per node (requests in prefill, KV headed to a decode node,
blocks promised that its last load report does not show) is computed from this table.

    OFFERED --commit--> PREFILL --first token--> DECODE --close--> (gone)
       (an offer in flight)  (prefill node computing)  (KV on / headed to the decode node;
                                                        the prefill node keeps its copy
                                                        until the transfer is reported done)

A redirect changes an attempt's decode node; a re-placement or an unanswered offer closes
the attempt and opens the next one (a new wire id, so late messages for the old one are
recognised as such).
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterator
from dataclasses import dataclass

from pdserve.gateway.requests import GatewayRequest


class Phase(enum.Enum):
    OFFERED = "offered"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Attempt:
    req: GatewayRequest
    wire_id: str
    prompt_len: int = 0  # tokens this attempt prefills (prompt + output kept so far)
    prefill: str | None = None  # node ids
    decode: str | None = None
    blocks: int = 0  # KV blocks promised on the decode node (prompt + first token)
    placed_at: float = 0.0  # when the decode node was promised them
    delivered_at: float = 0.0  # when the decode node had its KV (its decode work began)
    prefilled_at: float = 0.0  # when its first token came (the KV hand-off began)
    phase: Phase = Phase.OFFERED
    hashes: tuple[bytes, ...] = ()  # its prompt's block hashes (where its prefix is cached)
    # the decode node it last moved off (live migration): that node's last step's tokens
    # may be read after the move is over (another socket than its KvTransferred)
    moved_from: str | None = None
    # the decode node whose `Migrate` was read before the first token: answered once it is
    move_asked: str | None = None

    @property
    def final_len(self) -> int:
        """Its KV size once done, at most (prompt + max_tokens)."""
        return len(self.req.prompt_ids) + self.req.params.max_tokens

    @property
    def kv_len(self) -> int:
        """Tokens whose KV its node holds now: what it prefilled and every token made since
        but the newest (whose KV the next step computes; a move sends it in KvDone)."""
        return self.prompt_len + max(0, len(self.req.output_ids) - self.req.base - 1)

    def nodes(self) -> set[str]:
        return {n for n in (self.prefill, self.decode) if n is not None}


class RequestTable:
    def __init__(self) -> None:
        self.attempts: dict[str, Attempt] = {}  # by wire id
        self._on_node: dict[str, set[str]] = {}  # node id -> wire ids placed on it

    def __len__(self) -> int:
        return len(self.attempts)

    def __iter__(self) -> Iterator[Attempt]:
        return iter(list(self.attempts.values()))

    def get(self, wire_id: str) -> Attempt | None:
        return self.attempts.get(wire_id)

    def request(self, wire_id: str) -> GatewayRequest | None:
        attempt = self.attempts.get(wire_id)
        return attempt.req if attempt is not None else None

    def current(self, req: GatewayRequest) -> Attempt | None:
        attempt = self.attempts.get(req.wire_id)
        return attempt if attempt is not None and attempt.req is req else None

    # -- transitions ------------------------------------------------------------------------
    def open(self, req: GatewayRequest, prompt_len: int) -> Attempt:
        attempt = Attempt(req, req.wire_id, prompt_len)
        self.attempts[req.wire_id] = attempt
        return attempt

    def commit(self, attempt: Attempt, prefill: str, decode: str, blocks: int, now: float) -> None:
        """A prefill node accepted: the attempt holds it, and KV blocks on the decode node."""
        assert attempt.phase is Phase.OFFERED, attempt
        assert self.attempts.get(attempt.wire_id) is attempt, "commit of a closed attempt"
        attempt.prefill, attempt.phase = prefill, Phase.PREFILL
        self._place(attempt, decode, blocks, now)
        self._link(attempt, prefill)
        attempt.req.ran_on = {"prefill": prefill, "decode": decode}

    def redirect(self, attempt: Attempt, decode: str, blocks: int, now: float) -> None:
        """Its decode node refused the KV: another one takes it."""
        if attempt.decode is not None and attempt.decode != attempt.prefill:
            self._unlink(attempt, attempt.decode)
        self._place(attempt, decode, blocks, now)
        attempt.req.ran_on["decode"] = decode

    def migrate(self, attempt: Attempt, decode: str, blocks: int, now: float) -> None:
        """Its decode node drains and sends the KV on to `decode`: until that node has it,
        the old one holds the attempt as a prefill node would (its death re-places the
        request; its `KvTransferred` lets go). The attempt stays in DECODE: tokens go on
        from the new node under the same wire id."""
        old = attempt.decode
        if attempt.prefill is not None and attempt.prefill != old:
            self._unlink(attempt, attempt.prefill)  # acknowledged already: it holds nothing
        attempt.prefill = attempt.moved_from = old
        attempt.delivered_at = 0.0  # the new node's decode work starts when the KV lands
        self._place(attempt, decode, blocks, now)
        attempt.req.ran_on["decode"] = decode

    def stay(self, attempt: Attempt, now: float) -> None:
        """A migration found no decode node to take it: the node it was moving from (held
        as its prefill side) decodes it on."""
        if attempt.decode is not None and attempt.decode != attempt.prefill:
            self._unlink(attempt, attempt.decode)
        attempt.decode, attempt.prefill = attempt.prefill, None
        attempt.delivered_at = now
        if attempt.decode is not None:
            attempt.req.ran_on["decode"] = attempt.decode

    def prefilled(self, attempt: Attempt, now: float = 0.0) -> None:
        """The first token arrived: prefill is over. The prefill node keeps the KV (and the
        attempt stays on it: its death loses the request) until the decode node has it."""
        attempt.phase, attempt.prefilled_at = Phase.DECODE, now

    def delivered(self, attempt: Attempt, now: float) -> None:
        """The decode node acknowledged the KV: the prefill node holds nothing of it."""
        attempt.delivered_at = now
        if attempt.prefill is not None and attempt.prefill != attempt.decode:
            self._unlink(attempt, attempt.prefill)
            attempt.prefill = None

    def prefilled_in_place(self, attempt: Attempt, now: float) -> None:
        """Its decode node prefilled it (selective disaggregation): the KV is where it
        decodes, as if delivered; the node holds it as a decode node only."""
        attempt.delivered_at = now
        attempt.prefill = None

    def adopt(self, attempt: Attempt, node_id: str, now: float) -> None:
        """A resumed stream (gateway/resume.py): its KV is on `node_id`, decoding."""
        attempt.phase, attempt.delivered_at, attempt.placed_at = Phase.DECODE, now, now
        attempt.decode = node_id
        self._link(attempt, node_id)
        attempt.req.ran_on = {"decode": node_id}

    def close(self, wire_id: str) -> Attempt | None:
        attempt = self.attempts.pop(wire_id, None)
        if attempt is not None:
            for node in attempt.nodes():
                self._unlink(attempt, node)
        return attempt

    def renew(self, req: GatewayRequest) -> Attempt:
        """The attempt's wire id is spent (an offer went unanswered and may still be
        accepted): the request goes on as a fresh attempt under a new one."""
        old = self.close(req.wire_id)
        placing = req.timeline.get(f"placing.{req.attempt}")
        req.attempt += 1
        # tokens the spent attempt sent (a colocated node's, read before its late Accept)
        # are not the fresh one's: its token 0 would pull them into the stream
        req.pending.clear()
        req.gap_since = None
        if placing is not None:
            req.timeline[f"placing.{req.attempt}"] = placing
        fresh = self.open(req, old.prompt_len if old is not None else len(req.prompt_ids))
        fresh.hashes = old.hashes if old is not None else ()
        return fresh

    # -- what is on a node (derived) --------------------------------------------------------
    def work_since(self, node_id: str) -> float | None:
        """Since when the node has held work that must produce tokens: a prompt it accepted
        (its first token is due) or KV it acknowledged (its decode steps are due); None when
        it holds none. The gateway's progress lease (core.py) runs from here or from the
        node's last token, whichever is later."""
        starts = [
            a.placed_at if a.phase is Phase.PREFILL else a.delivered_at or a.placed_at
            for a in self.on_node(node_id)
            if (a.phase is Phase.PREFILL and a.prefill == node_id)
            or (a.phase is Phase.DECODE and a.decode == node_id and a.delivered_at)
            # a colocated node decodes what it prefilled: no KV is delivered to mark it
            or (a.phase is Phase.DECODE and a.decode == node_id == a.prefill)
        ]
        return min(starts) if starts else None

    def stalled_handoffs(self, now: float, limit: float, awake: float = 0.0) -> list[Attempt]:
        """Attempts whose KV has been on its way to the decode node for longer than `limit`
        (since the first token, or the redirect or move that chose that node, or `awake`:
        the end of the gateway's last stall, when their news may have waited unread): a
        hand-off lost (its `Redirect`, the link between the two nodes) that no node's
        progress lease sees, since both nodes go on with their other work."""
        return [
            a for a in self.attempts.values()
            if a.phase is Phase.DECODE and a.prefill is not None and a.decode is not None
            and a.prefill != a.decode and not a.delivered_at
            and now - max(a.placed_at, a.prefilled_at, awake) > limit
        ]  # fmt: skip

    def on_node(self, node_id: str) -> list[Attempt]:
        return [self.attempts[w] for w in self._on_node.get(node_id, ())]

    def in_prefill(self, node_id: str) -> list[Attempt]:
        return [
            a for a in self.on_node(node_id) if a.prefill == node_id and a.phase is Phase.PREFILL
        ]

    def headed_to(self, node_id: str) -> list[Attempt]:
        """Attempts whose KV is on, or on its way to, this decode node."""
        return [a for a in self.on_node(node_id) if a.decode == node_id]

    def promised(self, node_id: str, since: float, held: Container[str]) -> int:
        """KV blocks promised on a decode node that its last load report (at `since`, naming
        the requests it `held`) does not show: placed after it, or not reserved there yet
        (the node reserves when the KV's header comes, after the prefill node schedules
        the prompt: a heartbeat or more after the placement)."""
        return sum(
            a.blocks
            for a in self.headed_to(node_id)
            if a.placed_at > since or a.wire_id not in held
        )

    # -- internals --------------------------------------------------------------------------
    def _place(self, attempt: Attempt, decode: str, blocks: int, now: float) -> None:
        attempt.decode, attempt.blocks, attempt.placed_at = decode, blocks, now
        self._link(attempt, decode)

    def _link(self, attempt: Attempt, node_id: str) -> None:
        self._on_node.setdefault(node_id, set()).add(attempt.wire_id)

    def _unlink(self, attempt: Attempt, node_id: str) -> None:
        wires = self._on_node.get(node_id)
        if wires is not None:
            wires.discard(attempt.wire_id)
            if not wires:
                del self._on_node[node_id]
