"""Decode node: takes KV into its paged cache and runs continuous batching.

Intake (common/kv_transfer/intake.py, on the data ROUTER): a `KvHeader` reserves blocks for
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

import dataclasses
import logging
from typing import Any

from pdserve.common.engine.scheduler import SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import SeqStatus, Sequence, check_stop
from pdserve.common.kv_transfer.base import Intake
from pdserve.common.node import NodeRequest
from pdserve.common.node.handoff import KvHandoff
from pdserve.common.node.reserve import reserve_blocks
from pdserve.common.protocol import (
    Abort,
    Accept,
    Drain,
    FirstToken,
    KvHeader,
    Migrate,
    Preempted,
    PrefillOffer,
    Rebalance,
    Redirect,
    Reject,
)

log = logging.getLogger(__name__)


class DecodeNode(KvHandoff):
    role = "decode"
    mode = "decode"
    pushes_tokens = True
    has_data_plane = True  # receives request KV; serves prefix blocks peers fetch

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.to_park: dict[str, str] = {}  # migrating, in the running step: id -> reason

    def scheduler_config(self) -> SchedulerConfig:
        # every sequence that arrived decodes at each step: the KV it holds is its admission
        base = super().scheduler_config()
        return dataclasses.replace(base, max_num_seqs=1 << 30, max_batch_tokens=1 << 30)

    def extra_held(self) -> list[str]:
        return self.intake.active  # reserved, KV on its way

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case Abort(request_id=rid):
                self.abort(rid)
            case Drain():
                self.begin_drain()
            case Rebalance(request_ids=rids):
                for rid in () if self.draining else rids:  # a drain moves them all anyway
                    self.spawn(self.migrate(rid, "rebalance"))  # gone or moving: skipped
            case Redirect(request_id=rid, decode=target):  # where a migrating sequence goes
                self.spawn(self.send_kv(rid, target))
            case PrefillOffer():  # selective disaggregation: prefill it here
                await self._local_prefill(msg)
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        self.intake.drop(rid)  # still arriving: release the reservation
        self.sender.abort(rid)  # migrating: the target drops its reservation

    # -- live migration --------------------------------------------------------------------
    def begin_drain(self) -> None:
        first = not self.draining
        super().begin_drain()
        if first and self.cfg.drain_migrate == "on":
            for rid in list(self.requests):
                self.spawn(self.migrate(rid, "draining"))

    async def migrate(self, rid: str, reason: str) -> None:
        """Park the sequence and ask the gateway where it goes. One the running step computes
        is parked right after that step (`after_step`): the step loop never leaves a gap
        for a waiter while sequences run."""
        if rid in self.in_step:
            self.to_park[rid] = reason
        else:
            self._park(rid, reason)

    def keep(self, rid: str) -> bool:
        """No decode node can take a migrating sequence: finish it here (the drain waits
        for it, up to --drain-timeout, then hands it back for recompute)."""
        if not self.scheduler.resume(rid):
            return False
        self.work.set()
        return True

    def _park(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None or not self.scheduler.park(req.seq):
            return  # finished, aborted or already moving
        self.metrics.migrations.inc()
        self.spawn(self.send_gateway(Migrate(request_id=rid, reason=reason)))

    async def on_drain_timeout(self) -> None:
        await self.hand_back("draining")

    # -- selective disaggregation ----------------------------------------------------------
    async def _local_prefill(self, offer: PrefillOffer) -> None:
        """The gateway chose this node to prefill a request itself (`--local-prefill`,
        gateway/selective.py): accepted only if its blocks are free now, keeping the
        watermark, so it never waits here behind running sequences' growth."""
        rid, n = offer.request_id, len(offer.prompt_ids)
        bm, watermark = self.blocks, self.scheduler.cfg.watermark_blocks
        reason = None
        if self.draining:
            reason = "draining"
        elif rid in self.requests:
            reason = "duplicate request id"
        elif n >= self.engine.max_model_len:
            reason = f"prompt has {n} tokens; the context limit is {self.engine.max_model_len}"
        elif not bm.can_allocate(bm.blocks_needed(n + 1), reserve=watermark):
            reason = "KV cache full"
        if reason is not None:
            await self.send_gateway(Reject(request_id=rid, reason=reason, room=0))
            return
        seq = Sequence.new(rid, offer.prompt_ids, offer.params)
        self.scheduler.add(seq)
        self.requests[rid] = NodeRequest(seq)
        self.metrics.local_prefills.inc()
        await self.send_gateway(Accept(request_id=rid))
        self.work.set()

    # -- intake ----------------------------------------------------------------------------
    def reserve_kv(self, h: KvHeader) -> list[int] | str:
        """Blocks for the prompt and the first token, keeping the watermark free. With
        `skip_tokens`, the prefill node sends only the KV after a prefix the gateway saw in
        our cache: those blocks are taken from the cache (or, gone meanwhile, the header is
        refused so that the whole prompt's KV comes)."""
        n, skip = len(h.prompt_ids), h.skip_tokens
        if self.draining:
            return "draining"
        if h.request_id in self.requests:
            return "duplicate request id"
        if (
            skip % self.blocks.block_size
            or skip >= n
            or h.frame_bytes != self.engine.kv_frame_bytes(n - skip)
        ):
            return "KV layout mismatch"
        watermark = self.scheduler.cfg.watermark_blocks
        return reserve_blocks(self.blocks, h.prompt_ids, skip, n + 1, watermark)

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
        self.requests[h.request_id] = NodeRequest(seq)
        self.metrics.kv_received(h.backend, intake.bytes_in)
        self.scheduler.admit_prefilled(seq)
        self.work.set()
        if self.draining and self.cfg.drain_migrate == "on":  # it was on its way: move it on
            self.spawn(self.migrate(h.request_id, "draining"))

    # -- decoding --------------------------------------------------------------------------
    async def on_preempted(self, seqs: list[Sequence]) -> None:
        for seq in seqs:  # the scheduler freed its blocks: recompute happens elsewhere
            self.requests.pop(seq.seq_id, None)
            self.metrics.preemptions.inc()
            await self.push_tokens(
                Preempted(node_id=self.node_id, request_id=seq.seq_id, reason="out of KV blocks")
            )

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        self.metrics.generation_tokens.inc(len(grew))
        batch = []  # output index 0 was the prefill node's first token: these are 1 on
        for seq in grew:
            reason = check_stop(seq, self.engine.eos_token_ids, self.engine.max_model_len)
            if reason is not None:
                self.requests.pop(seq.seq_id, None)
                self.scheduler.finish(seq, reason)
            if seq.num_output_tokens == 1:  # prefilled here: its first token, as a prefill
                first = FirstToken(  # node reports one (KV that arrived came with it)
                    request_id=seq.seq_id, token_id=seq.token_ids[-1], finish_reason=reason
                )
                await self.send_gateway(first)
                continue
            batch.append((seq, reason))
        parking, self.to_park = self.to_park, {}
        for rid, why in parking.items():  # before the next step is scheduled
            self._park(rid, why)
        await self.push_step(batch)
