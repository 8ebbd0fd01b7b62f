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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import msgspec

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import SeqStatus, Sequence, check_stop
from pdserve.common.kv_transfer import listen_all, receivers_for
from pdserve.common.kv_transfer.base import Intake
from pdserve.common.kv_transfer.intake import KvIntake
from pdserve.common.node import NodeBase, NodeRequest
from pdserve.common.protocol import PREFIX_GONE, Abort, Drain, KvHeader, Preempted
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import TOKENS_MAX_MSG, bound_address, make_socket

log = logging.getLogger(__name__)


class DecodeNode(NodeBase):
    role = "decode"
    mode = "decode"
    pushes_tokens = True

    def __init__(
        self, cfg: NodeConfig, ecfg: EngineConfig, engine: Engine, tokenizer: Tokenizer
    ) -> None:
        super().__init__(cfg, ecfg, engine, tokenizer)
        max_frame = engine.kv_frame_bytes(engine.max_model_len) + 4096
        self.data = make_socket(
            self.ctx,
            "decode.data",
            f"tcp://*:{cfg.data_port}",
            max_msg=max(max_frame, TOKENS_MAX_MSG),
        )
        self._data_address = bound_address(self.data, self.cfg.advertise_host)
        self.intake = KvIntake(
            self.data,
            engine,
            self._reserve,
            self.blocks.free,
            self._admit,
            receivers_for(self.kv_local(self._data_address)),
            timeout=cfg.kv_transfer_timeout,
        )
        self.kv_endpoints: dict[str, str] = {}

    def scheduler_config(self) -> SchedulerConfig:
        # every sequence that arrived decodes at each step: the KV it holds is its admission
        base = super().scheduler_config()
        return dataclasses.replace(base, max_num_seqs=1 << 30, max_batch_tokens=1 << 30)

    def data_address(self) -> str:
        return self._data_address

    def info(self) -> Any:
        return msgspec.structs.replace(super().info(), kv_endpoints=self.kv_endpoints)

    def extra_held(self) -> list[str]:
        return self.intake.active  # reserved, KV on its way

    async def serve(self) -> None:
        self.kv_endpoints = await listen_all(self.intake.receivers, self.intake)
        self.tasks += [
            asyncio.create_task(self.intake.run()),
            asyncio.create_task(self._transfer_timeouts()),
        ]
        await super().serve()

    async def close_role(self) -> None:
        await self.intake.close()
        await super().close_role()
        self.data.close()

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case Abort(request_id=rid):
                self.abort(rid)
            case Drain():
                self.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        self.intake.drop(rid)  # still arriving: release the reservation

    async def on_drain_timeout(self) -> None:
        await self.hand_back("draining")

    # -- intake ----------------------------------------------------------------------------
    def _reserve(self, h: KvHeader) -> list[int] | str:
        """Blocks for the prompt and the first token, keeping the watermark free. With
        `skip_tokens`, the prefill node sends only the KV after a prefix the gateway saw in
        our cache: those blocks are taken from the cache (or, gone meanwhile, the header is
        refused so that the whole prompt's KV comes)."""
        bm, n, skip = self.blocks, len(h.prompt_ids), h.skip_tokens
        if self.draining:
            return "draining"
        if h.request_id in self.requests:
            return "duplicate request id"
        if (
            skip % bm.block_size
            or skip >= n
            or h.frame_bytes != self.engine.kv_frame_bytes(n - skip)
        ):
            return "KV layout mismatch"
        hits = bm.match(bm.hashes(h.prompt_ids[:skip])) if skip else []
        if len(hits) * bm.block_size < skip:
            return f"{PREFIX_GONE}: {len(hits) * bm.block_size} of {skip} tokens here"
        need = bm.blocks_needed(n + 1) - len(hits)
        idle = sum(1 for b in hits if bm.ref_counts[b] == 0)  # cached: in the free queue
        if not bm.can_allocate(need + idle, reserve=self.scheduler.cfg.watermark_blocks):
            return f"needs {need} KV blocks, {bm.num_free_blocks} free"
        bm.take(hits)
        return [*hits, *bm.allocate(need)]

    async def _admit(self, intake: Intake, first_token: int) -> None:
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

    async def _transfer_timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.intake.expire(time.monotonic())

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
            batch.append((seq, reason))
            if reason is not None:
                self.requests.pop(seq.seq_id, None)
                self.scheduler.finish(seq, reason)
        await self.push_step(batch)
