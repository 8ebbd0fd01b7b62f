"""Decode node: takes KV into its paged cache and runs continuous batching.

Intake (on the data ROUTER): a `KvHeader` reserves blocks for the prompt and the first token,
keeping the watermark free for running sequences to grow, or is answered `KvRefuse`. Each
`KvLayer` frame is scattered straight into the reserved blocks; `KvDone` brings the first
token, the sequence joins the running batch and the prefill node gets `KvAck`. A
reservation whose frames stall past `kv_transfer_timeout` is freed and refused.
Decoding: one engine step at a time in the engine thread; after each, one `TokenBatch` to the
gateway with the new token of every sequence. When blocks run out, the scheduler preempts
the newest sequence, which goes back to the gateway (`Preempted`) to be re-placed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import DecodeWork, Engine
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import SeqStatus, Sequence, check_stop
from pdserve.common.kv_transfer.intake import Intake, KvIntake
from pdserve.common.kv_transfer.tcp import TcpListener
from pdserve.common.node import NodeBase
from pdserve.common.protocol import Abort, Drain, KvHeader, Load, Preempted, TokenBatch
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import TOKENS_MAX_MSG, bound_address, make_socket

log = logging.getLogger(__name__)


class DecodeNode(NodeBase):
    role = "decode"
    pushes_tokens = True

    def __init__(
        self, cfg: NodeConfig, ecfg: EngineConfig, engine: Engine, tokenizer: Tokenizer
    ) -> None:
        super().__init__(cfg, ecfg, engine, tokenizer)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=1 << 30,
                max_batch_tokens=1 << 30,
                chunk_size=0,
                num_blocks=engine.num_blocks,
                block_size=engine.block_size,
                watermark_blocks=int(ecfg.watermark * engine.num_blocks),
            )
        )
        self.blocks = self.scheduler.block_manager
        max_frame = engine.kv_frame_bytes(engine.max_model_len) + 4096
        self.data = make_socket(
            self.ctx,
            "decode.data",
            f"tcp://*:{cfg.data_port}",
            max_msg=max(max_frame, TOKENS_MAX_MSG),
        )
        self._data_address = bound_address(self.data, self.cfg.advertise_host)
        self.ucx: Any = None
        self.tcp = TcpListener(
            self.cfg.advertise_host, cfg.kv_tcp_port, cfg.kv_transfer_timeout, max_frame
        )
        self.intake = KvIntake(
            self.data,
            engine,
            self._reserve,
            self.blocks.free,
            self._admit,
            timeout=cfg.kv_transfer_timeout,
        )
        self.seqs: dict[str, Sequence] = {}
        self.in_step: set[str] = set()
        self.aborted_in_step: set[str] = set()
        self.work = asyncio.Event()

    def data_address(self) -> str:
        return self._data_address

    def info(self) -> Any:
        info = msgspec.structs.replace(super().info(), tcp_address=self.tcp.address)
        if self.ucx is None:
            return info
        return msgspec.structs.replace(info, ucx_address=self.ucx.address)

    def load(self) -> Load:
        # blocks held back by the watermark are not offered: a header needing them is refused
        reserve = self.scheduler.cfg.watermark_blocks
        cached = self.blocks.num_cached_blocks
        free = max(0, self.blocks.num_free_blocks - cached - reserve)
        return Load(
            running=len(self.scheduler.running),
            waiting=len(self.intake.active),
            blocks_free=free,
            blocks_cached=cached,
            blocks_in_use=self.blocks.num_in_use_blocks,
            held=(*self.seqs, *self.intake.active),
            draining=self.draining,
        )

    def idle(self) -> bool:
        return not (self.seqs or self.intake.active)

    async def serve(self) -> None:
        if self.cfg.kv_backend == "ucx":
            from pdserve.common.kv_transfer.ucx import UcxListener

            self.ucx = self.intake.ucx = UcxListener(self.cfg.advertise_host)
        self.tcp.start(self.intake)
        self.tasks += [
            asyncio.create_task(self.intake.run()),
            asyncio.create_task(self._engine_loop()),
            asyncio.create_task(self._transfer_timeouts()),
        ]
        await super().serve()

    async def shutdown(self) -> None:
        await self.tcp.close()
        if self.ucx is not None:
            await self.ucx.close()
        await super().shutdown()

    def close_sockets(self) -> None:
        self.intake.close()
        self.data.close()

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case Abort(request_id=rid):
                self._abort(rid)
            case Drain():
                self.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    def _abort(self, rid: str) -> None:
        if self.intake.drop(rid):
            return
        seq = self.seqs.get(rid)
        if seq is None:
            return
        if rid in self.in_step:
            self.aborted_in_step.add(rid)  # its blocks are in use by the running step
            return
        self.seqs.pop(rid)
        self.scheduler.finish(seq, "abort")

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            log.info("lease expired for %s: freeing its KV", rid)
            self._abort(rid)

    async def on_drain_timeout(self) -> None:
        for rid in list(self.seqs):
            await self.push_tokens(
                Preempted(node_id=self.node_id, request_id=rid, reason="draining")
            )
            self._abort(rid)

    # -- intake ----------------------------------------------------------------------------
    def _reserve(self, h: KvHeader) -> list[int] | str:
        """Blocks for the prompt and the first token, keeping the watermark free."""
        if self.draining:
            return "draining"
        if h.request_id in self.intake.incoming or h.request_id in self.seqs:
            return "duplicate request id"
        if h.frame_bytes != self.engine.kv_frame_bytes(len(h.prompt_ids)):
            return "KV layout mismatch"
        need = self.blocks.blocks_needed(len(h.prompt_ids) + 1)
        if not self.blocks.can_allocate(need, reserve=self.scheduler.cfg.watermark_blocks):
            return f"needs {need} KV blocks, {self.blocks.num_free_blocks} free"
        return self.blocks.allocate(need)

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
        self.seqs[h.request_id] = seq
        self.metrics.kv_received(h.backend, intake.bytes_in)
        self.scheduler.admit_prefilled(seq)
        self.work.set()

    async def _transfer_timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.intake.expire(time.monotonic())

    # -- decoding --------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        while True:
            await self.work.wait()
            self.work.clear()
            while self.scheduler.running:
                await self._step()

    async def _step(self) -> None:
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.scheduler.waiting.remove(seq)  # recompute happens elsewhere: hand it back
            self.seqs.pop(seq.seq_id, None)
            self.metrics.preemptions.inc()
            await self.push_tokens(
                Preempted(node_id=self.node_id, request_id=seq.seq_id, reason="out of KV blocks")
            )
        if not sched.decodes:
            return
        work = [
            DecodeWork(s.seq_id, s.token_ids[-1], s.num_tokens - 1, list(s.block_table), s.params)
            for s in sched.decodes
        ]
        self.in_step = {s.seq_id for s in sched.decodes}
        started = time.monotonic()
        try:
            tokens = await self.run_engine(self.engine.step, [], work)
        finally:
            self.in_step = set()
        self.metrics.step_time.observe(time.monotonic() - started)
        self.metrics.generation_tokens.inc(len(tokens))
        grew = self.scheduler.on_step_done(sched, tokens)
        ids, toks, indices, reasons = [], [], [], []
        for seq in grew:
            if seq.seq_id in self.aborted_in_step:
                continue
            reason = check_stop(seq, self.engine.eos_token_ids, self.engine.max_model_len)
            ids.append(seq.seq_id)
            toks.append(seq.token_ids[-1])
            indices.append(seq.num_output_tokens - 1)  # 0 is the prefill node's first token
            reasons.append(reason)
            if reason is not None:
                self.seqs.pop(seq.seq_id, None)
                self.scheduler.finish(seq, reason)
        for rid in self.aborted_in_step:
            self._abort(rid)
        self.aborted_in_step = set()
        if ids:
            await self.push_tokens(
                TokenBatch(
                    node_id=self.node_id,
                    request_ids=ids,
                    token_ids=toks,
                    indices=indices,
                    finish_reasons=reasons,
                )
            )
