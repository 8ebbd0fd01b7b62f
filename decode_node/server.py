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
from dataclasses import dataclass, field
from typing import Any

import zmq

from common.config import EngineConfig, NodeConfig
from common.engine.interface import DecodeWork, Engine
from common.engine.scheduler import Scheduler, SchedulerConfig
from common.engine.sequence import SeqStatus, Sequence, check_stop
from common.node import NodeBase
from common.protocol import (
    TO_DECODE_DECODER,
    Abort,
    Drain,
    KvAck,
    KvDone,
    KvHeader,
    KvLayer,
    KvRefuse,
    Load,
    Msg,
    Preempted,
    TokenBatch,
    encode,
)
from common.tokenizer import Tokenizer
from common.transport import TOKENS_MAX_MSG, bound_address, decode_or_none, make_socket

log = logging.getLogger(__name__)


@dataclass
class Intake:
    header: KvHeader
    peer: bytes
    block_table: list[int]
    started: float
    layers: set[int] = field(default_factory=set)


class DecodeNode(NodeBase):
    role = "decode"

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
        self._data_address = bound_address(self.data, cfg.advertise_host)
        self.tokens_sock: zmq.asyncio.Socket | None = None
        self.intake: dict[str, Intake] = {}
        self.seqs: dict[str, Sequence] = {}
        self.in_step: set[str] = set()
        self.aborted_in_step: set[str] = set()
        self.work = asyncio.Event()

    def data_address(self) -> str:
        return self._data_address

    def load(self) -> Load:
        return Load(
            running=len(self.scheduler.running),
            waiting=len(self.intake),
            blocks_free=self.blocks.num_free_blocks - self.blocks.num_cached_blocks,
            blocks_cached=self.blocks.num_cached_blocks,
            blocks_in_use=self.blocks.num_in_use_blocks,
            held=(*self.seqs, *self.intake),
            draining=self.draining,
        )

    def idle(self) -> bool:
        return not (self.seqs or self.intake)

    async def serve(self) -> None:
        self.tasks += [
            asyncio.create_task(self._data_loop()),
            asyncio.create_task(self._engine_loop()),
            asyncio.create_task(self._transfer_timeouts()),
        ]
        await super().serve()

    def close_sockets(self) -> None:
        self.data.close()
        if self.tokens_sock is not None:
            self.tokens_sock.close()

    async def on_registered(self) -> None:
        if self.tokens_sock is None:
            self.tokens_sock = make_socket(self.ctx, "decode.tokens", self.tokens_address)

    async def _push(self, msg: Msg) -> None:
        await self.registered.wait()
        assert self.tokens_sock is not None
        await self.tokens_sock.send(encode(msg))

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
        intake = self.intake.pop(rid, None)
        if intake is not None:
            self.blocks.free(intake.block_table)
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
            await self._push(Preempted(node_id=self.node_id, request_id=rid, reason="draining"))
            self._abort(rid)

    # -- intake ----------------------------------------------------------------------------
    async def _data_loop(self) -> None:
        while True:
            parts = await self.data.recv_multipart(copy=False)
            peer, payload = parts[0].bytes, parts[1].bytes
            msg = decode_or_none(TO_DECODE_DECODER, payload) if len(parts) >= 2 else None
            try:
                match msg:
                    case KvHeader():
                        await self._on_header(peer, msg)
                    case KvLayer(request_id=rid, layer=layer) if len(parts) == 3:
                        self._on_layer(rid, layer, parts[2].buffer)
                    case KvDone(request_id=rid, first_token_id=token):
                        await self._on_done(peer, rid, token)
                    case Abort(request_id=rid):
                        self._abort(rid)
                    case _:
                        log.warning("dropping malformed data message")
            except Exception:
                log.exception("KV intake failed")

    async def _refuse(self, peer: bytes, rid: str, reason: str) -> None:
        await self.data.send_multipart([peer, encode(KvRefuse(request_id=rid, reason=reason))])

    async def _on_header(self, peer: bytes, h: KvHeader) -> None:
        if self.draining:
            return await self._refuse(peer, h.request_id, "draining")
        if h.request_id in self.intake or h.request_id in self.seqs:
            return await self._refuse(peer, h.request_id, "duplicate request id")
        if h.frame_bytes != self.engine.kv_frame_bytes(len(h.prompt_ids)):
            return await self._refuse(peer, h.request_id, "KV layout mismatch")
        need = self.blocks.blocks_needed(len(h.prompt_ids) + 1)
        if not self.blocks.can_allocate(need, reserve=self.scheduler.cfg.watermark_blocks):
            free = self.blocks.num_free_blocks
            return await self._refuse(peer, h.request_id, f"needs {need} KV blocks, {free} free")
        self.intake[h.request_id] = Intake(h, peer, self.blocks.allocate(need), time.monotonic())

    def _on_layer(self, rid: str, layer: int, frame: memoryview) -> None:
        intake = self.intake.get(rid)
        if intake is None:
            return  # refused, aborted or timed out: drop
        n = len(intake.header.prompt_ids)
        self.engine.import_kv(layer, intake.block_table, n, frame)
        intake.layers.add(layer)

    async def _on_done(self, peer: bytes, rid: str, first_token: int) -> None:
        intake = self.intake.pop(rid, None)
        if intake is None:
            return
        h = intake.header
        if len(intake.layers) != h.num_layers:
            self.blocks.free(intake.block_table)
            return await self._refuse(peer, rid, f"got {len(intake.layers)}/{h.num_layers} layers")
        seq = Sequence(
            seq_id=rid,
            token_ids=[*h.prompt_ids, first_token],
            num_prompt_tokens=h.num_prompt_tokens,
            params=h.params,
            block_table=intake.block_table,
            num_computed_tokens=len(h.prompt_ids),
            status=SeqStatus.RUNNING,
        )
        self.seqs[rid] = seq
        self.scheduler.admit_prefilled(seq)
        await self.data.send_multipart([peer, encode(KvAck(request_id=rid))])
        self.work.set()

    async def _transfer_timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, intake in list(self.intake.items()):
                if now - intake.started > self.cfg.kv_transfer_timeout:
                    log.warning(
                        "KV of %s stalled for %.1f s: freeing its reservation",
                        rid,
                        now - intake.started,
                    )
                    self._abort(rid)
                    await self._refuse(intake.peer, rid, "KV transfer timed out")

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
            await self._push(
                Preempted(node_id=self.node_id, request_id=seq.seq_id, reason="out of KV blocks")
            )
        if not sched.decodes:
            return
        work = [
            DecodeWork(s.seq_id, s.token_ids[-1], s.num_tokens - 1, list(s.block_table), s.params)
            for s in sched.decodes
        ]
        self.in_step = {s.seq_id for s in sched.decodes}
        try:
            tokens = await self.run_engine(self.engine.step, [], work)
        finally:
            self.in_step = set()
        grew = self.scheduler.on_step_done(sched, tokens)
        ids, toks, reasons = [], [], []
        for seq in grew:
            if seq.seq_id in self.aborted_in_step:
                continue
            reason = check_stop(seq, self.engine.eos_token_ids, self.engine.max_model_len)
            ids.append(seq.seq_id)
            toks.append(seq.token_ids[-1])
            reasons.append(reason)
            if reason is not None:
                self.seqs.pop(seq.seq_id, None)
                self.scheduler.finish(seq, reason)
        for rid in self.aborted_in_step:
            self._abort(rid)
        self.aborted_in_step = set()
        if ids:
            await self._push(
                TokenBatch(
                    node_id=self.node_id, request_ids=ids, token_ids=toks, finish_reasons=reasons
                )
            )
