"""On-demand forwarding: offer a request to prefill nodes until one accepts (P/D-Serve).

There is no queue at the gateway or at the nodes. A request tries the prefill candidates in
the policy's order; each node answers Accept or Reject at once. After a full pass of
rejects it backs off until capacity may have freed (a first token came back, a node
registered) or a short delay passes, and tries again, until `placement_timeout`.
Requests waiting for capacity take turns in arrival order: only the oldest waiting request
makes offers, so none starves behind newer ones.
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
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.schedulers import PlacementPolicy, blocks_for

log = logging.getLogger(__name__)
BACKOFF_S = 0.02

SendOffer = Callable[[NodeState, PrefillOffer], Awaitable[None]]


class PlacementTimeout(Exception):
    """No prefill node accepted within the placement timeout."""


class Placer:
    def __init__(
        self,
        cluster: ClusterView,
        policy: PlacementPolicy,
        send_offer: SendOffer,
        placement_timeout: float,
        offer_timeout: float,
        on_answer: Callable[[NodeState, bool | None], None] | None = None,
        renew: Callable[[GatewayRequest], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.send_offer = send_offer
        self.placement_timeout = placement_timeout
        self.offer_timeout = offer_timeout
        self.on_answer = on_answer
        self.renew = renew  # gives the request a new wire id after an unanswered offer
        self.waiting: deque[GatewayRequest] = deque()
        self.answers: dict[str, _Offer] = {}  # the offer in flight, per wire id
        self.capacity = asyncio.Event()

    def capacity_changed(self) -> None:
        self.capacity.set()

    def answer(self, wire_id: str, identity: bytes, accepted: bool) -> bool:
        """An Accept or Reject arrived from the node with `identity`; False if it answers no
        offer in flight: a late answer to an offer that timed out, when the request has moved
        on (to another node, or it was placed). Matching the node matters: a late Accept from
        node A must not be taken for node B's answer to the same request."""
        offer = self.answers.get(wire_id)
        if offer is None or offer.node.identity != identity or offer.answer.done():
            return False
        del self.answers[wire_id]
        if accepted:  # committed now, before this loop reads the node's next message
            offer.commit()
        offer.answer.set_result(accepted)
        return True

    async def place(
        self,
        req: GatewayRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        exclude_decode: frozenset[str] = frozenset(),
    ) -> None:
        """Returns once a prefill node accepted; raises PlacementTimeout."""
        deadline = time.monotonic() + self.placement_timeout
        self.waiting.append(req)
        try:
            while True:
                if self.waiting[0] is req:
                    self.capacity.clear()
                    if await self._one_pass(req, prompt_ids, params, exclude_decode):
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
        self,
        req: GatewayRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        exclude_decode: frozenset[str],
    ) -> bool:
        colocated = self.cluster.alive("colocated")
        if colocated:  # the colocated baseline: one engine runs both phases of a request
            order = self.policy.prefill_order(colocated, len(prompt_ids))
            pairs = [(node, node) for node in order]
        else:
            decode = self.policy.pick_decode(
                self.cluster.alive("decode"), len(prompt_ids), set(exclude_decode)
            )
            if decode is None:
                return False
            order = self.policy.prefill_order(self.cluster.alive("prefill"), len(prompt_ids))
            pairs = [(node, decode) for node in order]
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
                        "queued": p.load.waiting + p.load.running,
                        "accepts": p.accepts,
                        "decode": d.node_id,
                        "decode_free_blocks": d.free_blocks,
                    }
                    for p, d in pairs
                ],
            )
        for node, decode in pairs:
            if req.finished:
                return True  # cancelled while waiting
            wire_id = req.wire_id
            offer = PrefillOffer(
                request_id=wire_id,
                prompt_ids=prompt_ids,
                params=params,
                decode=decode.target(),
                num_generated=len(req.output_ids),
            )
            pending = _Offer(req, node, decode, len(prompt_ids))
            self.answers[wire_id] = pending
            answer: bool | None = None  # None: no answer in time
            try:
                await self.send_offer(node, offer)
                answer = await asyncio.wait_for(pending.answer, self.offer_timeout)
            except asyncio.TimeoutError:  # first: TimeoutError is an OSError too
                log.warning("offer of %s to %s got no answer", wire_id, node.node_id)
                if self.renew is not None:
                    self.renew(req)  # the node may accept later: that wire id is spent
            except OSError as exc:  # never reached the node
                log.warning("offer of %s to %s failed (%r)", wire_id, node.node_id, exc)
            finally:
                self.answers.pop(wire_id, None)
            if self.on_answer is not None:
                self.on_answer(node, answer)
            if answer:
                return True
        return False


@dataclass
class _Offer:
    """An offer in flight. Accepting it commits the placement at once (`commit`), in the
    same step that reads the Accept: the node's FirstToken, read right after on the same
    socket, must find the request placed."""

    req: GatewayRequest
    node: NodeState
    decode: NodeState
    prompt_len: int
    answer: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def commit(self) -> None:
        wire_id, decode = self.req.wire_id, self.decode
        self.node.in_prefill[wire_id] = self.prompt_len
        decode.decoding.add(wire_id)
        decode.assigned += 1
        decode.reserved_blocks += blocks_for(decode, self.prompt_len + 1)
        self.req.prefill_node, self.req.decode_node = self.node.node_id, decode.node_id
