"""Decode node: takes KV into its paged cache and runs continuous batching.

Intake (common/kv/intake.py, on the data ROUTER): a `KvHeader` reserves blocks for
the prompt and the first token, keeping the watermark free for running sequences to grow, or
is answered `KvRefuse`; the frames land in the reserved blocks, by whichever KV backend the
prefill node chose. Once complete, the sequence joins the running batch (`admit`) and the
prefill node gets `KvAck`.
Decoding runs on the node runtime's step loop (common/node/runtime.py): after each step, one
`TokenBatch` to the gateway with the new token of every sequence. When blocks run out, the
scheduler (decode mode) preempts the newest sequence, which goes back to the gateway
(`Preempted`) to be re-placed.
Draining (SIGTERM, `Drain`) with `--drain-migrate on` moves every running sequence to another
decode node with its KV (live migration): after the step that computes it, the sequence is
parked (off the batch, blocks held), the gateway names a target (`Migrate` -> `Redirect`), and
the KV goes there as a prefill node sends it (common/node/handoff.py), the newest token in
`KvDone`; the target decodes on under the same wire id, so the client's stream continues with
no token lost, repeated or recomputed. No target: the node decodes it on itself, as a drain
without migration would (recompute elsewhere only at --drain-timeout).
The gateway may also ask a node that is filling up to move some sequences (`Rebalance`,
`--rebalance`): the same path, while the node goes on serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from pdserve.common.engine.scheduler import Mode, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import SeqStatus, Sequence, check_stop
from pdserve.common.engine.step_work import step_work
from pdserve.common.kv.base import Intake, Transfer
from pdserve.common.node.defaults import RoleDefaults
from pdserve.common.node.handoff import KvHandoff
from pdserve.common.node.offers import offer_refusal
from pdserve.common.node.reserve import reserve_blocks
from pdserve.common.node.role import NodeRequest
from pdserve.common.node.runtime import NodeRuntime
from pdserve.common.wire.kv_messages import (
    KvHeader,
)
from pdserve.common.wire.protocol import (
    Abort,
    Accept,
    Drain,
    FirstToken,
    Migrate,
    PrefillOffer,
    Rebalance,
    Redirect,
    Reject,
)

log = logging.getLogger(__name__)


ADOPTED_MOVE_S = 1.0  # an orphan adopted while the node drains is moved on this much later


class DecodeRole(RoleDefaults):
    role = "decode"
    mode: Mode = "decode"
    pushes_tokens = True
    has_data_plane = True  # receives request KV; serves prefix blocks peers fetch

    def __init__(self, node: NodeRuntime) -> None:
        super().__init__(node)
        self.to_park: dict[str, str] = {}  # migrating, in the running step: id -> reason
        self.handoff = KvHandoff(node, keep=self.keep)  # live migration

    @staticmethod
    def scheduler_config(base: SchedulerConfig) -> SchedulerConfig:
        # every sequence that arrived decodes at each step, whatever the budget (decode mode):
        # the KV it holds is its admission. --chunk-size (chunked), else --max-batch-tokens,
        # bounds the prompts it prefills itself in one step: the stall its streams see
        return dataclasses.replace(base, max_num_seqs=1 << 30, mode="decode")

    def extra_held(self) -> list[str]:
        return self.node.intake.active  # reserved, KV on its way

    def promised_blocks(self) -> int:
        """Blocks the local prompts accepted and still waiting take at admission (prompt and
        first token): kept from later offers and KV headers, and reported as in use."""
        bm = self.node.blocks
        return sum(bm.blocks_needed(s.num_tokens + 1) for s in self.node.scheduler.waiting)

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case Abort(request_id=rid):
                self.node.abort(rid)
            case Drain():
                self.node.control.begin_drain()
            case Rebalance(request_ids=rids):
                for rid in () if self.node.draining else rids:  # a drain moves them all anyway
                    self.node.spawn(self.migrate(rid, "rebalance"))  # gone or moving: skipped
            case Redirect(request_id=rid, decode=target):  # where a migrating sequence goes
                self.node.spawn(self.handoff.send_kv(rid, target))
            case PrefillOffer():  # selective disaggregation: prefill it here
                await self._local_prefill(msg)
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        self.node.intake.drop(rid)  # still arriving: release the reservation
        self.node.sender.abort(rid)  # migrating: the target drops its reservation

    # -- live migration --------------------------------------------------------------------
    def on_drain(self) -> None:
        if self.node.cfg.drain_migrate == "on":
            for rid in list(self.node.requests):
                self.node.spawn(self.migrate(rid, "draining"))

    def on_adopted(self, rid: str) -> None:
        # an orphan decodes on through a drain (no gateway to ask where it goes); adopted,
        # it has one: moved on as the others were, not handed back at the drain's timeout
        if self.node.draining and self.node.cfg.drain_migrate == "on":
            self.node.spawn(self._move_adopted(rid))

    async def _move_adopted(self, rid: str) -> None:
        # its Migrate asked at once is read by the adopter before its resume has the stream
        # in its table (the answer wakes the resume; the next message is handled first):
        # "stay" (Redirect None). A resume takes a round of answers at most (ROUND_S)
        await asyncio.sleep(ADOPTED_MOVE_S)
        if rid in self.node.requests:
            await self.migrate(rid, "draining")

    def kv_acked(self, t: Transfer) -> None:
        self.handoff.acked(t)

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        await self.handoff.refused(rid, peer, why)

    async def migrate(self, rid: str, reason: str) -> None:
        """Park the sequence and ask the gateway where it goes. One the running step computes
        is parked right after that step (`after_step`): the step loop never leaves a gap
        for a waiter while sequences run."""
        if rid in self.node.steps.in_step:
            self.to_park[rid] = reason
        else:
            self._park(rid, reason)

    def keep(self, rid: str) -> bool:
        """No decode node can take a migrating sequence: finish it here (the drain waits
        for it, up to --drain-timeout, then hands it back for recompute)."""
        if not self.node.scheduler.resume(rid):
            return False
        self.node.steps.wake()
        return True

    def _park(self, rid: str, reason: str) -> None:
        req = self.node.requests.get(rid)
        if self.node.orphan(rid):
            return  # no gateway to ask where it goes: decoded here, for an adopter
        if req is None or not self.node.scheduler.park(req.seq):
            return  # finished, aborted or already moving
        self.node.metrics.migrations.inc()
        self.node.spawn(self.node.send_gateway(Migrate(request_id=rid, reason=reason)))

    async def on_drain_timeout(self) -> None:
        await self.node.hand_back("draining")

    # -- selective disaggregation ----------------------------------------------------------
    async def _local_prefill(self, offer: PrefillOffer) -> None:
        """The gateway chose this node to prefill a request itself (`--local-prefill`,
        gateway/selective.py): accepted only if its blocks are free now, keeping the
        watermark and what the local prompts accepted before it take (the scheduler
        allocates at admission), so it never waits here behind running sequences' growth."""
        rid, n = offer.request_id, len(offer.prompt_ids)
        bm = self.node.blocks
        keep = self.node.scheduler.cfg.watermark_blocks + self.promised_blocks()
        reason = None
        if self.node.draining:
            reason = "draining"
        elif rid in self.node.requests:
            reason = "duplicate request id"
        elif (reason := offer_refusal(offer, *self.node.engine_limits())) is not None:
            log.warning("refusing local prefill %s: %s", rid, reason)
        elif not bm.can_allocate(bm.blocks_needed(n + 1), reserve=keep):
            reason = "KV cache full"
        if reason is not None:
            await self.node.send_gateway(Reject(request_id=rid, reason=reason, room=0))
            return
        seq = Sequence.new(rid, offer.prompt_ids, offer.params)
        self.node.scheduler.add(seq)
        self.node.requests[rid] = NodeRequest(seq, prompt_len=offer.prompt_len,
                                              stream_format=offer.stream_format)  # fmt: skip
        await self.node.send_gateway(Accept(request_id=rid))
        self.node.steps.wake()

    def _prefilled(self, req: NodeRequest, reason: str | None, ended: float) -> FirstToken:
        """A local prompt's first token (KV that arrived came with its own), timed and
        counted as a prefill node's, whatever its finish."""
        seq, metrics = req.seq, self.node.metrics
        queued, prefill = max(0.0, req.began - req.accepted_at), ended - req.began
        metrics.local_prefills.inc()
        metrics.queue_time.observe(queued)
        metrics.prefill_time.observe(prefill)
        metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        return FirstToken(request_id=seq.seq_id, token_id=seq.token_ids[-1], finish_reason=reason,
                          prefill_ms=prefill * 1000, queue_ms=queued * 1000)  # fmt: skip

    # -- intake ----------------------------------------------------------------------------
    def reserve_kv(self, h: KvHeader) -> list[int] | str:
        """Blocks for the prompt and the first token, keeping the watermark free. With
        `skip_tokens`, the prefill node sends only the KV after a prefix the gateway saw in
        our cache: those blocks are taken from the cache (or, gone meanwhile, the header is
        refused so that the whole prompt's KV comes). Accepted local prompts keep theirs."""
        n, skip = len(h.prompt_ids), h.skip_tokens
        if self.node.draining:
            return "draining"
        if h.request_id in self.node.requests:
            return "duplicate request id"
        if n >= self.node.engine.max_model_len:  # its first step would be past the context
            return f"{n} tokens: longer than this node's context"
        if not h.fetch and not self.node.control.gateways.adopt(h.request_id, h.gateway):
            return "not registered with the request's gateway, or its id is another's"
        if (
            skip % self.node.blocks.block_size
            or skip >= n
            or h.frame_bytes != self.node.engine.kv_store.frame_bytes(n - skip)
        ):
            return "KV layout mismatch"
        keep = self.node.scheduler.cfg.watermark_blocks + self.promised_blocks()
        return reserve_blocks(self.node.blocks, h.prompt_ids, skip, n + 1, keep)

    async def admit_kv(self, intake: Intake, first_token: int) -> None:
        h = intake.header
        seq = Sequence(
            seq_id=h.request_id,
            token_ids=[*h.prompt_ids, first_token],
            num_prompt_tokens=h.num_prompt_tokens,
            params=h.params,
            block_table=intake.block_table,
            num_computed_tokens=len(h.prompt_ids),
            status=SeqStatus.RUNNING,
        )
        self.node.requests[h.request_id] = NodeRequest(seq, prompt_len=h.prompt_len,
                                                       stream_format=h.stream_format)  # fmt: skip
        self.node.metrics.kv_received(h.backend, intake.bytes_in)
        self.node.scheduler.admit_prefilled(seq)
        self.node.steps.wake()
        if self.node.draining and self.node.cfg.drain_migrate == "on":  # on its way: move it on
            self.node.spawn(self.migrate(h.request_id, "draining"))

    # -- decoding --------------------------------------------------------------------------
    async def on_preempted(self, seqs: list[Sequence]) -> None:
        for seq in seqs:  # the scheduler freed its blocks: recompute happens elsewhere
            self.node.metrics.preemptions.inc()
            req = self.node.requests.pop(seq.seq_id, None)
            await self.node.give_back(seq.seq_id, req, "out of KV blocks")

    def engine_step(
        self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop
    ) -> tuple[list[int], float, float]:
        began = time.monotonic()  # a local prefill's queue and prefill times, as a prefill node's
        sampled = self.node.engine.step(*step_work(out))
        return sampled, began, time.monotonic()

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        _, began, ended = result
        for seq, _ in out.prefills:  # a prompt in chunks: its prefill began at the first
            if (req := self.node.requests.get(seq.seq_id)) is not None and not req.began:
                req.began = began
        self.node.metrics.generation_tokens.inc(len(grew))
        batch = []  # output index 0 was the prefill node's first token: these are 1 on
        for seq in grew:
            if (req := self.node.requests.get(seq.seq_id)) is None:  # aborted during a send
                continue
            reason = check_stop(seq, self.node.engine.eos_token_ids, self.node.engine.max_model_len)
            if reason is not None:
                self.node.finished(seq, reason)
            if seq.num_output_tokens == 1:  # prefilled here: its first token, as a prefill
                await self.node.send_gateway(self._prefilled(req, reason, ended))
                if reason is None and self.node.draining and self.node.cfg.drain_migrate == "on":
                    self.to_park[seq.seq_id] = "draining"  # waiting when the drain began
                continue
            batch.append((seq, reason))
        parking, self.to_park = self.to_park, {}
        for rid, why in parking.items():  # before the next step is scheduled
            self._park(rid, why)
        # aborted during a later send of this loop: its token is not sent either
        batch = [(s, r) for s, r in batch if r is not None or s.seq_id in self.node.requests]
        await self.node.push_step(batch)
