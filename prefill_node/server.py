"""Prefill node: answers offers at once, prefills batches, streams KV to decode nodes.

Offers are answered by the engine scheduler in prefill mode (common/engine/scheduler.py,
`can_take`): on demand, accept only while the batch has room; with a baseline policy (the
gateway says so at registration), accept whatever could fit and queue. Batches run on the
node runtime's step loop (common/node/runtime.py). For each batch: send every request's
`KvHeader` to its decode node (so it reserves blocks while we compute), run the forward
pass in the engine thread, and as each layer's KV lands in the cache, stage that layer for
the KV connector and queue it to the decode peer (the event loop sends it while the next
layer computes); prompts shorter than `layerwise_min_tokens` are staged after the pass. Then
the first token goes straight to the gateway (`FirstToken`), `KvDone` to the decode node, and
the blocks stay held (the scheduler parks the sequence) until `KvAck`. A request finished at
its first token is not handed off (the decode node gets `Abort`). On `KvRefuse` we ask the
gateway for another decode node (`NeedDecode` -> `Redirect`) and resend from the cache
(common/node/handoff.py, shared with a draining decode node's live migration).
An offer whose prefix another node's cache holds (the gateway's hint) may first fetch those
blocks from it (common/node/fetch.py); the request is scheduled once they have landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from pdserve.common.engine.scheduler import Mode, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import Sequence, check_stop
from pdserve.common.engine.step_work import step_work
from pdserve.common.kv.base import Transfer
from pdserve.common.kv.sender import TransferEnded
from pdserve.common.node.defaults import RoleDefaults
from pdserve.common.node.fairness import Room
from pdserve.common.node.fetch import PrefixFetches
from pdserve.common.node.handoff import KvHandoff
from pdserve.common.node.offers import offer_refusal
from pdserve.common.node.role import NodeRequest
from pdserve.common.node.runtime import NodeRuntime
from pdserve.common.wire.protocol import (
    Abort,
    Accept,
    Drain,
    FirstToken,
    PrefillFailed,
    PrefillOffer,
    Redirect,
    RegisterAck,
    Reject,
)
from pdserve.prefill_node.layerwise import BatchTails, LayerwiseRule

log = logging.getLogger(__name__)


class PrefillRole(RoleDefaults):
    role = "prefill"
    mode: Mode = "prefill"
    has_data_plane = True  # sends KV; receives prefix blocks it fetches

    def __init__(self, node: NodeRuntime) -> None:
        super().__init__(node)
        self.queueing = False  # until the gateway says otherwise at registration
        self.layerwise = LayerwiseRule(node.cfg.layerwise, node.cfg.layerwise_min_tokens)
        self.tails = BatchTails(self.layerwise)
        self.handoff = KvHandoff(node)

    @staticmethod
    def scheduler_config(base: SchedulerConfig) -> SchedulerConfig:
        # whole prompts (a chunk's KV would stream before the prompt is done) and no
        # watermark: nothing grows here
        return dataclasses.replace(base, chunk_size=0, watermark_blocks=0)

    def on_registered(self, ack: RegisterAck) -> None:
        self.queueing = ack.queueing  # the gateway's policy decides
        # the baselines' node queue keeps arrival order (common/engine/pass_order.py)
        sched = self.node.scheduler
        pass_tokens = 0 if ack.queueing else self.node.ecfg.prefill_pass_tokens
        sched.cfg = dataclasses.replace(sched.cfg, pass_tokens=pass_tokens)

    def room(self) -> Room | None:
        """On demand: the longest prompt and the batch slots an offer may take now."""
        if self.queueing:
            return None
        sched = self.node.scheduler
        fetching = [f.seq for f in self.fetches.fetching.values()]
        busy = len(sched.next_batch(fetching))
        return Room(sched.room(False, fetching), sched.cfg.max_num_seqs - busy)

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case PrefillOffer():
                await self._on_offer(msg)
            case Redirect(request_id=rid, decode=target):
                # spawned: it waits for the running pass, and this loop must keep answering
                # offers meanwhile (an offer unanswered for --offer-timeout is lost)
                self.node.spawn(self.handoff.send_kv(rid, target))
            case Abort(request_id=rid):
                self.node.abort(rid)
            case Drain():
                self.node.control.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    async def _on_offer(self, offer: PrefillOffer) -> None:
        rid = offer.request_id
        fetching = [f.seq for f in self.fetches.fetching.values()]
        room = -1  # with a reject: the longest prompt we would take now (-1: not known)
        if self.node.draining:
            reason: str | None = "draining"
            room = 0
        elif rid in self.node.requests:
            # the same request offered again: the first acceptance stands (one per id)
            reason = "duplicate request id"
        elif (reason := offer_refusal(offer, *self.node.engine_limits())) is not None:
            log.warning("refusing offer %s: %s", rid, reason)
        else:
            reason = self.node.scheduler.can_take(len(offer.prompt_ids), self.queueing, fetching)
            if reason is not None:
                room = self.node.scheduler.room(self.queueing, fetching)
        self.node.metrics.offer(reason is None)
        if reason is not None:
            await self.node.send_gateway(Reject(request_id=rid, reason=reason, room=room))
            return
        seq = Sequence.new(rid, offer.prompt_ids, offer.params)
        bs = self.node.engine.block_size  # whole blocks of ours (a decode node's may differ)
        req = NodeRequest(seq, target=offer.decode, skip=offer.decode_cached // bs * bs,
                          prompt_len=offer.prompt_len,
                          stream_format=offer.stream_format)  # fmt: skip
        self.node.requests[rid] = req
        await self.node.send_gateway(Accept(request_id=rid))
        if self.node.requests.get(rid) is not req:  # aborted while the Accept went out
            return
        if not self.fetches.start(seq, offer):  # else scheduled once its prefix is here
            self.node.scheduler.add(seq)
            self.node.steps.wake()

    def kv_acked(self, t: Transfer) -> None:
        if t.prefill_end:  # a first send (not a resend after a refusal): how long it took
            self.tails.acked(t.request_id, t.finished)
        else:  # a resend's: the first send's batch gives no sample
            self.tails.lost(t.request_id)
        self.handoff.acked(t)

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        self.tails.lost(rid)
        await self.handoff.refused(rid, peer, why)

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        self.tails.lost(rid)
        self.node.sender.abort(rid)  # the decode node drops its reservation

    # -- a batch ---------------------------------------------------------------------------
    async def before_step(self, out: SchedulerOutput) -> None:
        for seq, _ in out.prefills:
            req = self.node.requests[seq.seq_id]
            if seq.params.max_tokens > 1 and req.target is not None:
                # it will be handed off: the decode node reserves while we compute
                self.node.sender.begin(
                    seq.seq_id,
                    req.target,
                    seq.token_ids,
                    seq.num_prompt_tokens,
                    seq.params,
                    seq.block_table,
                    skip=req.skip,
                    gateway=self.node.gateway_of(seq.seq_id),
                    prompt_len=req.prompt_len,
                    stream_format=req.stream_format,
                )

    def engine_step(
        self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop
    ) -> tuple[list[int], dict[str, list[Any]], float, float, dict[str, Transfer]]:
        """Engine thread: one forward pass. Layer-wise, each layer's KV goes out as it lands
        (the send overlaps the next layers' compute); else it is staged whole after the
        pass. Which, the rule decides from this node's measurements (layerwise.py)."""
        moving = [t for s, _ in out.prefills if (t := self.node.sender.transfers.get(s.seq_id))]
        tokens = sum(n for _, n in out.prefills)
        d = self.layerwise.decide(tokens, sum(t.total_bytes for t in moving))
        if d.why == "threshold":
            layerwise = [t for t in moving if t.num_tokens >= self.node.cfg.layerwise_min_tokens]
        else:
            layerwise = moving if d.layerwise else []
        for t in layerwise:
            t.layerwise = True
        if moving:
            self.node.metrics.kv_send_mode(bool(layerwise), d.why)
            log.debug("batch of %d tokens: %s (%s; predicted layer-wise %s s, at end %s s)",
                      tokens, "layer-wise" if layerwise else "at end", d.why,
                      d.predicted_layerwise_s, d.predicted_at_end_s)  # fmt: skip

        sender = self.node.sender

        def on_layer(layer: int) -> None:
            for t in layerwise:
                with contextlib.suppress(TransferEnded):  # released mid-pass: nothing to send
                    loop.call_soon_threadsafe(sender.push, t, layer, sender.stage(t, layer))

        began = time.monotonic()
        sampled = self.node.engine.step(*step_work(out), on_layer if layerwise else None)
        ended = time.monotonic()
        at_end = {}
        for t in moving:
            if t not in layerwise:
                with contextlib.suppress(TransferEnded):
                    at_end[t.request_id] = sender.stage_all(t)
        return sampled, at_end, began, ended, {t.request_id: t for t in moving}

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        _, at_end, began, ended, passed = result
        streamed = any(t.layerwise for t in passed.values())
        self.layerwise.observe_pass(sum(n for _, n in out.prefills), ended - began, streamed)
        tails = self.tails.open(ended)  # one tail sample for the pass's transfers
        for seq in grew:
            req = self.node.requests.get(seq.seq_id)
            if req is None:  # let go while an earlier one's FirstToken waited to go (an abort)
                continue
            queued = max(0.0, began - req.accepted_at)
            self.node.metrics.queue_time.observe(queued)
            self.node.metrics.prefill_time.observe(ended - began)
            self.node.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
            t = self.node.sender.transfers.get(seq.seq_id)
            # a resend begun meanwhile (a refusal mid-pass, then a Redirect) is another
            # transfer: this pass's KV and KvDone are not its (it sends its own, whole)
            ours = passed.get(seq.seq_id) if t is not None and passed.get(seq.seq_id) is t else None
            if ours is not None:
                ours.prefill_end = ended
                if seq.seq_id in at_end:
                    self.node.sender.push_all(ours, at_end[seq.seq_id])
            token = seq.token_ids[-1]
            reason = check_stop(seq, self.node.engine.eos_token_ids, self.node.engine.max_model_len)
            if reason is not None or t is None:  # nothing to hand off: let go now
                self.node.requests.pop(seq.seq_id)
                self.node.scheduler.release(seq.seq_id)
                self.node.sender.abort(seq.seq_id)
                self.node.steps.wake()
                if reason is not None:  # it ended here: kept for a resume as a decode node's
                    self.node.control.adoption.ended(req, reason)
            if reason is None and ours is not None:  # before the await: a drop meanwhile
                self.tails.add(tails, ours.request_id, ours.total_bytes, ours.layerwise)
            first = FirstToken(
                request_id=seq.seq_id,
                token_id=token,
                finish_reason=reason,
                prefill_ms=(ended - began) * 1000,
                queue_ms=queued * 1000,
            )
            await self.node.send_gateway(first)
            if reason is None and ours is not None:
                self.node.sender.done(ours, token)
        self.tails.seal(tails)

    async def step_failed(self, out: SchedulerOutput, exc: Exception) -> None:
        """The batch fails, the node goes on: the gateway re-places its requests."""
        log.error("prefill failed", exc_info=exc)
        for seq, _ in out.prefills:
            self.node.drop(seq.seq_id)
            await self.node.send_gateway(PrefillFailed(request_id=seq.seq_id, reason=repr(exc)))

    @property
    def fetches(self) -> PrefixFetches:
        assert self.node.kv is not None
        return self.node.kv.fetches
