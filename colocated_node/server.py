"""Colocated node: the baseline disaggregation must beat, behind the same gateway and API.

One engine runs both phases on the node runtime's step loop (common/node/runtime.py), the
scheduler in colocated mode: continuous batching, chunked prefill with `--chunk-size`,
preemption by recompute. A long prompt joining the batch delays every decoding stream in it,
which is exactly the interference disaggregation removes. It accepts every offer that could
ever fit (the scheduler queues, as vLLM does), reports each request's first token to the
gateway (`FirstToken`, for the same TTFT accounting) and later tokens as one `TokenBatch`
per engine step.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.common.engine.scheduler import Mode, SchedulerOutput
from pdserve.common.engine.sequence import Sequence, check_stop
from pdserve.common.node.defaults import RoleDefaults
from pdserve.common.node.offers import offer_refusal
from pdserve.common.node.role import NodeRequest
from pdserve.common.wire.protocol import (
    Abort,
    Accept,
    Drain,
    FirstToken,
    PrefillOffer,
    Reject,
)

log = logging.getLogger(__name__)


class ColocatedRole(RoleDefaults):
    role = "colocated"
    mode: Mode = "colocated"
    pushes_tokens = True

    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case PrefillOffer():
                await self._on_offer(msg)
            case Abort(request_id=rid):
                self.node.abort(rid)
            case Drain():
                self.node.control.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    async def _on_offer(self, offer: PrefillOffer) -> None:
        rid = offer.request_id
        reason = "draining" if self.node.draining else None
        if rid in self.node.requests:
            reason = "duplicate request id"
        if refused := offer_refusal(offer, *self.node.engine_limits()):
            reason = refused
            log.warning("refusing offer %s: %s", rid, reason)
        seq = Sequence.new(rid, offer.prompt_ids or [0], offer.params)  # (an empty one: refused)
        if reason is None:
            try:
                self.node.scheduler.add(seq)
            except ValueError as exc:
                reason = str(exc)
        self.node.metrics.offer(reason is None)
        if reason is not None:
            room = 0 if self.node.draining else -1  # it queues: room is only its cache
            await self.node.send_gateway(Reject(request_id=rid, reason=reason, room=room))
            return
        self.node.requests[rid] = NodeRequest(seq, prompt_len=offer.prompt_len,
                                              stream_format=offer.stream_format)  # fmt: skip
        self.node.metrics.prompt_tokens.inc(len(offer.prompt_ids))
        await self.node.send_gateway(Accept(request_id=rid))
        self.node.steps.wake()

    async def on_drain_timeout(self) -> None:
        await self.node.hand_back("draining")

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        self.node.metrics.generation_tokens.inc(len(grew))
        batch = []
        for seq in grew:
            if seq.seq_id not in self.node.requests:  # aborted while this loop awaited a send
                continue
            reason = check_stop(seq, self.node.engine.eos_token_ids, self.node.engine.max_model_len)
            if reason is not None:
                self.node.finished(seq, reason)
            if seq.num_output_tokens == 1:  # its first token: as a prefill node sends it
                await self.node.send_gateway(
                    FirstToken(
                        request_id=seq.seq_id, token_id=seq.token_ids[-1], finish_reason=reason
                    )
                )
                continue
            batch.append((seq, reason))
        # aborted during a later send of this loop: its token is not sent either
        batch = [(s, r) for s, r in batch if r is not None or s.seq_id in self.node.requests]
        await self.node.push_step(batch)
