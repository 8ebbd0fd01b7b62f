"""On-demand forwarding: offer a request to prefill nodes until one accepts (P/D-Serve).

There is no queue at the gateway or at the nodes. The placer asks `plan()` (gateway/plan.py)
for the (prefill, decode) pairs to try and offers the request to each in turn; each node
answers Accept or Reject at once.

Waiting requests are placed in rounds, one at a time, by one task: a round runs when capacity
may have freed (a first token came back, a node reported or registered), when a request
arrives, or after a short back-off. Each round lets every waiting request try, in the order of
the admission policy (gateway/admission.py: fifo, shortest prefill first, deadline first),
so any request may take capacity that fits it: a long prompt no node can take yet does not
hold back a short one. A node that rejects says how long a prompt it would still take now
(`Reject.room`); for the rest of the round it is offered nothing longer, and the round ends
early once no node has room, so a full cluster costs one offer per node per round.

An offer is answered by the node it went to, or not at all within `offer_timeout`: then its
wire id is spent (the node may accept later, and that acceptance must be told apart from the
request's next offer, maybe to the same node) and the request goes on as a new attempt.
Accepting commits the placement in the request table at once (`_Offer.commit`), in the same
step that reads the Accept, so the node's next message finds the request placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdserve.common.aio import wait_event, within
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import PrefillOffer
from pdserve.gateway.admission import Waiting, keep_for, order, urgent
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.plan import Snapshot, request_hashes
from pdserve.gateway.policies import Need, NodeView, Policy
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.selective import LocalPrefill
from pdserve.gateway.table import Attempt, Phase, RequestTable

log = logging.getLogger(__name__)
BACKOFF_S = 0.02

SendOffer = Callable[[NodeState, PrefillOffer], Awaitable[None]]


class PlacementTimeout(Exception):
    """No prefill node accepted within the placement timeout."""


@dataclass
class _Offer:
    attempt: Attempt
    node: NodeView
    decode: NodeView
    answer: asyncio.Future[bool | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    room: int = -1  # with a Reject: the longest prompt the node would take now
    lost: bool = False  # accepted after a node of the pair left or its attempt closed: aborted

    def commit(self, table: RequestTable) -> None:
        blocks = self.decode.blocks_for(self.attempt.prompt_len + 1)
        table.commit(self.attempt, self.node.node_id, self.decode.node_id, blocks, time.monotonic())


@dataclass(eq=False)
class _Waiting:
    req: GatewayRequest
    prompt_ids: list[int]
    params: SamplingParams
    need: Need
    entry: Waiting
    until: float  # its placement deadline (monotonic)
    reserved: str | None = None  # the node kept free for it once it waited too long
    rejected_by: set[str] = field(default_factory=set)  # nodes that said no in this round
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(frozen=True)
class Admission:
    """How waiting requests take turns (gateway/admission.py)."""

    order: str = "spf"
    max_wait: float = 3.0  # seconds after which a request goes first, oldest first
    aging: float = 0.5  # spf: seconds of prefill forgiven per second waited
    ttft_slo: float = math.inf  # deadline: seconds from arrival to the first token


class Placer:
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        policy: Policy,
        send_offer: SendOffer,
        index: PrefixIndex | None,
        placement_timeout: float,
        offer_timeout: float,
        on_answer: Callable[[NodeState, bool | None], None] | None = None,
        admission: Admission = Admission(),
        local: LocalPrefill | None = None,
    ) -> None:
        self.cluster = cluster
        self.table = table
        self.policy = policy
        self.index = index
        self.send_offer = send_offer
        self.placement_timeout = placement_timeout
        self.offer_timeout = offer_timeout
        self.on_answer = on_answer  # (node, True | False | None for no answer)
        self.admission = admission
        self.local = local  # selective disaggregation (gateway/selective.py); None: off
        self.waiting: dict[int, _Waiting] = {}  # by id() of the request
        self.offers: dict[str, _Offer] = {}  # the offer in flight, per wire id
        self.capacity = asyncio.Event()
        self._arrivals = itertools.count()
        self._rounds: asyncio.Task[None] | None = None

    def capacity_changed(self) -> None:
        if self.waiting:  # nothing waits: no round (a new request starts one itself)
            self.capacity.set()

    async def stop(self) -> None:
        if self._rounds is not None:
            self._rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rounds
        for w in self.waiting.values():
            w.done.cancel()

    def answer(self, wire_id: str, identity: bytes, accepted: bool, room: int = -1) -> bool:
        """An Accept or Reject arrived from the node with `identity`; False if it answers no
        offer in flight (a late answer to an offer that timed out)."""
        offer = self.offers.get(wire_id)
        if offer is None or offer.node.node.identity != identity or offer.answer.done():
            return False
        del self.offers[wire_id]
        if accepted and not all(self.cluster.holds(v.node) for v in (offer.node, offer.decode)):
            # a node of the pair left while the offer was out: placed there, the request
            # would wait on a node nobody watches (its leaving re-placed only what it held)
            offer.lost = True
            offer.answer.set_result(None)
            return False  # the caller aborts the acceptance on the node
        if self.table.get(wire_id) is not offer.attempt:
            # its client left (or it moved on) while the offer was out: the attempt is closed,
            # and an acceptance must not link nodes to it (the caller aborts it on the node);
            # not the node's refusal either (counted as one, its room taken as full)
            offer.lost = True
            offer.answer.set_result(None)
            return False
        if accepted:
            offer.commit(self.table)
        offer.room = room
        offer.answer.set_result(accepted)
        return True

    def prefill_seconds(self, tokens: int) -> float:
        """Estimated prefill time: the prefill nodes' measured seconds per token (median),
        else the cost model's."""
        costs = sorted(
            n.load.token_cost
            for role in ("prefill", "colocated")
            for n in self.cluster.alive(role)
            if n.load.token_cost > 0
        )
        if costs:
            return tokens * costs[len(costs) // 2]
        return self.policy.cost.prefill_seconds(tokens)

    def uncached(self, need: Need, on: str | None = None) -> int:
        """Tokens no node's cache holds (the best holder's), or that node `on`'s lacks."""
        if self.index is None or not need.hashes:
            return need.prompt_len
        held = self.index.holders(need.hashes)
        best = held.get(on, 0) if on is not None else max(held.values(), default=0)
        ref = self.cluster.reference
        return need.prompt_len - best * (ref.block_size if ref else 0)

    def queued_seconds(self) -> float:
        """Estimated prefill work waiting at the gateway, per prefill node."""
        nodes = len(self.cluster.alive("prefill")) + len(self.cluster.alive("colocated"))
        work = sum(w.entry.prefill_s for w in self.waiting.values())
        return work / max(1, nodes)

    async def place(
        self, req: GatewayRequest, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        """Returns once a prefill node accepted (the table holds the placement); raises
        PlacementTimeout."""
        now = time.monotonic()
        hashes = request_hashes(self.cluster, prompt_ids) if self.index is not None else ()
        final = len(req.prompt_ids) + req.params.max_tokens  # prompt_ids: + output so far
        need = Need(len(prompt_ids), hashes=hashes, output_len=max(0, final - len(prompt_ids)))
        adm = self.admission
        entry = Waiting(
            key=next(self._arrivals),
            arrived=req.arrival,
            prefill_s=self.prefill_seconds(self.uncached(need)),
            deadline=req.arrival + adm.ttft_slo,
            resumed=bool(req.output_ids),
        )
        superseded = self.waiting.get(id(req))
        if superseded is not None and not superseded.done.done():
            # placed again while waiting (its attempt was closed meanwhile): the newer call
            # owns the request now; the older one returns without placing anything
            superseded.done.set_result(None)
        waiting = self.waiting[id(req)] = _Waiting(
            req, prompt_ids, params, need, entry, now + self.placement_timeout
        )
        if self._rounds is None or self._rounds.done():
            self._rounds = asyncio.create_task(self._run_rounds())
        self.capacity.set()  # a round at once: this request may fit now
        try:
            await waiting.done
        finally:
            if self.waiting.get(id(req)) is waiting:
                del self.waiting[id(req)]

    async def _run_rounds(self) -> None:
        while True:
            self.capacity.clear()
            try:
                await self._round()
            except Exception:  # never end placement; the requests still waiting stay so
                log.exception("placement round failed")
            if not self.waiting:
                await self.capacity.wait()
                continue
            await wait_event(self.capacity, BACKOFF_S)

    async def _round(self) -> None:
        now = time.monotonic()
        by_key = {w.entry.key: w for w in self.waiting.values()}
        adm = self.admission
        ordered = order(adm.order, [w.entry for w in by_key.values()], now, adm.max_wait, adm.aging)
        room: dict[str, int] = {}  # node id -> the longest prompt it takes this round
        nodes = {n.node_id for r in ("prefill", "colocated") for n in self.cluster.alive(r)}
        snap = Snapshot(self.cluster, self.table, self.index)
        for entry in ordered:
            w = by_key[entry.key]
            if self.waiting.get(id(w.req)) is not w or w.done.done():
                continue  # gone (cancelled) meanwhile
            if w.req.finished:  # its client left while it was being placed again (a spawned
                w.done.set_result(None)  # re-placement nobody cancels): no longer waiting
                continue
            if time.monotonic() >= w.until:
                w.done.set_exception(PlacementTimeout())
                continue
            if nodes and all(room.get(n, 1) <= 0 for n in nodes):
                continue  # no node takes anything more this round: only deadlines now
            w.rejected_by.clear()
            try:
                placed = await self._one_pass(w, room, snap)
            except Exception as exc:  # the request answers 500 rather than wait forever
                if not w.done.done():
                    w.done.set_exception(exc)
                continue
            if placed and not w.done.done():
                w.done.set_result(None)
            elif not placed and urgent(entry, now, adm.max_wait):
                self._reserve(w, room, nodes)

    def _local_first(
        self, w: _Waiting, pairs: list[tuple[NodeView, NodeView]], snap: Snapshot
    ) -> list:
        """Selective disaggregation: the decode node first, as its own prefill node, when
        the rule says so (only there, for `always`); the decision goes in the timeline."""
        assert self.local is not None
        need = w.need
        decode = pairs[0][1] if pairs else self.policy.pick_decode(snap.base("decode"), need)
        if decode is None:
            return pairs
        tokens = self.uncached(need, decode.node_id)  # it fetches nothing: its own cache counts
        prefill = snap.base("prefill")
        made = self.local.decide(
            tokens, self.prefill_seconds(tokens), decode, prefill, self.queued_seconds()
        )
        w.req.timeline[f"local_prefill.{w.req.attempt}"] = made.fields()  # type: ignore[assignment]
        if not made.local:
            return pairs
        return [(decode, decode)] + ([] if self.local.mode == "always" else pairs)

    def _reserve(self, w: _Waiting, room: dict[str, int], nodes: set[str]) -> None:
        """An urgent request no node took keeps one of those that refused it now, for as
        long as it lives and refuses (admission.keep_for); offers unanswered keep nothing."""
        w.reserved = keep_for(w.reserved, w.rejected_by & nodes, room, self._capacity,
                              w.need.prompt_len)  # fmt: skip

    def _capacity(self, node_id: str) -> int:
        node = self.cluster.nodes.get(node_id)
        return node.info.num_blocks * node.info.block_size if node is not None else 0

    async def _one_pass(self, w: _Waiting, room: dict[str, int], snap: Snapshot) -> bool:
        req, prompt_ids, need = w.req, w.prompt_ids, w.need
        pairs = snap.plan(self.policy, need)
        if self.local is not None:
            pairs = self._local_first(w, pairs, snap)
        n = need.prompt_len
        pairs = [(p, d) for p, d in pairs if room.get(p.node_id, n) >= n]  # else: rejects it
        if log.isEnabledFor(logging.DEBUG):  # every decision with the numbers it used
            log.debug(
                "%s %s (%d tokens): offers %s",
                self.policy.name,
                req.wire_id,
                len(prompt_ids),
                [
                    {
                        "prefill": p.node_id,
                        "in_prefill": len(p.in_prefill),
                        "queued": p.queued,
                        "accepts": p.node.accepts,
                        "cached_blocks": p.cached,
                        "fetchable_blocks": p.holder_blocks - p.cached if p.holder else 0,
                        "decode": d.node_id,
                        "decode_free_blocks": d.free_blocks,
                        "decode_cached_blocks": d.cached,
                    }
                    for p, d in pairs
                ],
            )
        for node, decode in pairs:
            attempt = self.table.current(req)
            if req.finished or attempt is None or attempt.phase is not Phase.OFFERED:
                return True  # cancelled or placed otherwise while waiting: nothing to offer
            if not all(self.cluster.holds(v.node) and not v.node.load.draining
                       for v in (node, decode)):  # fmt: skip
                continue  # gone or draining since the plan (an unanswered offer took seconds)
            attempt.hashes = need.hashes
            # the decode node's cache holds this much of the prompt: its KV need not travel
            # (at least one token always does; the node checks, and asks for all if it lost it)
            skip = min(decode.cached, (len(prompt_ids) - 1) // decode.block_size)
            holder = node.holder
            offer = PrefillOffer(
                request_id=attempt.wire_id,
                prompt_ids=prompt_ids,
                params=w.params,
                decode=decode.node.target(),
                decode_cached=skip * decode.block_size,
                # another node's cache holds more of the prompt: the node may fetch it
                fetch_from=holder.target() if holder is not None else None,
                fetch_tokens=node.holder_tokens,
                waited_ms=(time.monotonic() - req.arrival) * 1000,
                prompt_len=len(req.prompt_ids),
                stream_format=req.stream_format(),
                foreign_prefill=sum(node.node.foreign.prefill),
            )
            pending = self.offers[attempt.wire_id] = _Offer(attempt, node, decode)
            snap.stale()  # while it is answered, reports and answers change the views
            answer: bool | None = None  # None: no answer in time
            try:
                await self.send_offer(node.node, offer)
                answer = await within(pending.answer, self.offer_timeout)
            except asyncio.TimeoutError:  # first: TimeoutError is an OSError too
                if pending.answer.done() and not pending.answer.cancelled():
                    # answered in the turn the deadline fell in: the wait then raises
                    # though the answer is in (the attempt committed: keep it)
                    answer = pending.answer.result()
                else:
                    log.warning("offer of %s to %s got no answer", attempt.wire_id, node.node_id)
                    if self.table.current(req) is attempt:
                        self.table.renew(req)  # the node may accept later: that id is spent
            except OSError as exc:  # never reached the node
                log.warning("offer of %s to %s failed (%r)", attempt.wire_id, node.node_id, exc)
            finally:
                if pending.lost and self.table.current(req) is attempt:
                    self.table.renew(req)  # accepted, then aborted there: that wire id is spent
                if self.offers.get(attempt.wire_id) is pending:
                    del self.offers[attempt.wire_id]
            if pending.lost:
                continue  # neither a no nor a silence of the node: its room stands
            if self.on_answer is not None:
                self.on_answer(node.node, answer)
            if answer:
                if node.node_id in room:
                    room[node.node_id] -= need.prompt_len
                return True
            # rejected: it said what it still takes (else: less than this); no answer: nothing
            took = pending.room if pending.room >= 0 else need.prompt_len - 1
            room[node.node_id] = took if answer is False else 0
            if answer is False:
                w.rejected_by.add(node.node_id)
        return False
