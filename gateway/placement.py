"""On-demand forwarding: offer a request to prefill nodes until one accepts (P/D-Serve).

There is no queue at the gateway or at the nodes. The placer asks `plan()` (gateway/plan.py)
for the (prefill, decode) pairs to try and offers the request to each in turn; each node
answers Accept or Reject at once. After a full pass of rejects it backs off until capacity may
have freed (a first token came back, a node registered) or a short delay passes, and tries
again, until `placement_timeout`. Requests waiting for capacity take turns in arrival order:
only the oldest waiting request makes offers, so none starves behind newer ones.

An offer is answered by the node it went to, or not at all within `offer_timeout`: then its
wire id is spent (the node may accept later, and that acceptance must be told apart from the
request's next offer, maybe to the same node) and the request goes on as a new attempt.
Accepting commits the placement in the request table at once (`_Offer.commit`), in the same
step that reads the Accept, so the node's next message finds the request placed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdserve.common.protocol import PrefillOffer
from pdserve.common.sampling import SamplingParams
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.plan import plan, request_hashes
from pdserve.gateway.policies import Need, NodeView, Policy
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.table import Attempt, RequestTable

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
    answer: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def commit(self, table: RequestTable) -> None:
        blocks = self.decode.blocks_for(self.attempt.prompt_len + 1)
        table.commit(self.attempt, self.node.node_id, self.decode.node_id, blocks, time.monotonic())


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
    ) -> None:
        self.cluster = cluster
        self.table = table
        self.policy = policy
        self.index = index
        self.send_offer = send_offer
        self.placement_timeout = placement_timeout
        self.offer_timeout = offer_timeout
        self.on_answer = on_answer  # (node, True | False | None for no answer)
        self.waiting: deque[GatewayRequest] = deque()
        self.offers: dict[str, _Offer] = {}  # the offer in flight, per wire id
        self.capacity = asyncio.Event()

    def capacity_changed(self) -> None:
        self.capacity.set()

    def answer(self, wire_id: str, identity: bytes, accepted: bool) -> bool:
        """An Accept or Reject arrived from the node with `identity`; False if it answers no
        offer in flight (a late answer to an offer that timed out)."""
        offer = self.offers.get(wire_id)
        if offer is None or offer.node.node.identity != identity or offer.answer.done():
            return False
        del self.offers[wire_id]
        if accepted:
            offer.commit(self.table)
        offer.answer.set_result(accepted)
        return True

    async def place(
        self, req: GatewayRequest, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        """Returns once a prefill node accepted (the table holds the placement); raises
        PlacementTimeout."""
        deadline = time.monotonic() + self.placement_timeout
        hashes = request_hashes(self.cluster, prompt_ids) if self.index is not None else ()
        need = Need(len(prompt_ids), hashes=hashes)
        self.waiting.append(req)
        try:
            while True:
                if self.waiting[0] is req:
                    self.capacity.clear()
                    if await self._one_pass(req, prompt_ids, params, need):
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PlacementTimeout
                try:
                    await asyncio.wait_for(self.capacity.wait(), min(BACKOFF_S, remaining))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting.remove(req)
            self.capacity.set()  # let the next oldest try at once

    async def _one_pass(
        self, req: GatewayRequest, prompt_ids: list[int], params: SamplingParams, need: Need
    ) -> bool:
        pairs = plan(self.policy, self.cluster, self.table, need, self.index)
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
            if req.finished or attempt is None:
                return True  # cancelled while waiting
            attempt.hashes = need.hashes
            # the decode node's cache holds this much of the prompt: its KV need not travel
            # (at least one token always does; the node checks, and asks for all if it lost it)
            skip = min(decode.cached, (len(prompt_ids) - 1) // decode.block_size)
            holder = node.holder
            offer = PrefillOffer(
                request_id=attempt.wire_id,
                prompt_ids=prompt_ids,
                params=params,
                decode=decode.node.target(),
                decode_cached=skip * decode.block_size,
                # another node's cache holds more of the prompt: the node may fetch it
                fetch_from=holder.target() if holder is not None else None,
                fetch_tokens=node.holder_blocks * node.block_size,
            )
            pending = self.offers[attempt.wire_id] = _Offer(attempt, node, decode)
            answer: bool | None = None  # None: no answer in time
            try:
                await self.send_offer(node.node, offer)
                answer = await asyncio.wait_for(pending.answer, self.offer_timeout)
            except asyncio.TimeoutError:  # first: TimeoutError is an OSError too
                log.warning("offer of %s to %s got no answer", attempt.wire_id, node.node_id)
                if self.table.current(req) is attempt:
                    self.table.renew(req)  # the node may accept later: that wire id is spent
            except OSError as exc:  # never reached the node
                log.warning("offer of %s to %s failed (%r)", attempt.wire_id, node.node_id, exc)
            finally:
                if self.offers.get(attempt.wire_id) is pending:
                    del self.offers[attempt.wire_id]
            if self.on_answer is not None:
                self.on_answer(node.node, answer)
            if answer:
                return True
        return False
