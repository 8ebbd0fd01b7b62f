"""Prefill node: answers offers at once, prefills batches, streams KV to decode nodes.

For each batch: allocate KV blocks, send every job's `KvHeader` to its decode node (so it
reserves blocks while we compute), run the forward pass in the engine thread, and as each
layer's KV lands in the cache, export that layer as one contiguous frame and queue it to
the decode peer (the event loop sends it while the next layer computes). After the pass,
the first token goes straight to the gateway (`FirstToken`), then `KvDone` to the decode
node; the blocks stay ours until `KvAck`. A request finished at its first token is not
handed off (the decode node gets `Abort` and frees its reservation). On `KvRefuse` we ask
the gateway for another decode node (`NeedDecode` -> `Redirect`) and resend from the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.interface import Engine, PrefillWork
from pdserve.common.kv_transfer.sender import KvSender, Transfer
from pdserve.common.node import NodeBase, host_identity
from pdserve.common.protocol import (
    Abort,
    Accept,
    DecodeTarget,
    Drain,
    FirstToken,
    KvTransferred,
    Load,
    NeedDecode,
    PrefillFailed,
    PrefillOffer,
    Redirect,
    Reject,
)
from pdserve.common.tokenizer import Tokenizer
from pdserve.prefill_node.batcher import PrefillBatcher, PrefillJob

log = logging.getLogger(__name__)


class PrefillNode(NodeBase):
    role = "prefill"

    def __init__(
        self, cfg: NodeConfig, ecfg: EngineConfig, engine: Engine, tokenizer: Tokenizer
    ) -> None:
        super().__init__(cfg, ecfg, engine, tokenizer)
        self.blocks = BlockManager(engine.num_blocks, engine.block_size)
        self.batcher = PrefillBatcher(
            ecfg.max_batch,
            ecfg.max_batch_tokens,
            engine.block_size,
            engine.num_blocks,
            cfg.queueing,
        )
        self.sender = KvSender(
            self.ctx,
            self.node_id,
            host_identity(),
            engine,
            cfg.kv_backend,
            on_ack=self._on_ack,
            on_refuse=self._on_refuse,
        )
        self.transfers: dict[str, Transfer] = {}  # of the batch being computed
        self.handed_off: dict[str, PrefillJob] = {}  # KV sent or being sent, until KvAck
        self.work = asyncio.Event()
        self.pass_over: asyncio.Future[None] | None = None  # resolved when the pass ends

    def data_address(self) -> str:
        return ""

    def load(self) -> Load:
        held = [j.request_id for j in (*self.batcher.pending, *self.batcher.running)]
        held += list(self.handed_off)
        cached = self.blocks.num_cached_blocks
        return Load(
            running=len(self.batcher.running),
            waiting=len(self.batcher.pending),
            blocks_free=self.blocks.num_free_blocks - cached,
            blocks_cached=cached,
            blocks_in_use=self.blocks.num_in_use_blocks,
            held=tuple(held),
            draining=self.draining,
        )

    def idle(self) -> bool:
        return not (self.batcher.pending or self.batcher.running or self.handed_off)

    def holds(self, rid: str) -> bool:
        jobs = (*self.batcher.pending, *self.batcher.running)
        return rid in self.handed_off or any(j.request_id == rid for j in jobs)

    async def serve(self) -> None:
        self.tasks.append(asyncio.create_task(self._engine_loop()))
        await super().serve()

    async def shutdown(self) -> None:
        await self.sender.close()
        await super().shutdown()

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case PrefillOffer():
                await self._on_offer(msg)
            case Redirect(request_id=rid, decode=target):
                # spawned: it waits for the running pass, and this loop must keep answering
                # offers meanwhile (an offer unanswered for --offer-timeout is lost)
                self.spawn(self._on_redirect(rid, target))
            case Abort(request_id=rid):
                self._abort(rid)
            case Drain():
                self.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    async def _on_offer(self, offer: PrefillOffer) -> None:
        job = PrefillJob(
            request_id=offer.request_id,
            prompt_ids=offer.prompt_ids,
            params=offer.params,
            decode=offer.decode,
            num_prompt_tokens=len(offer.prompt_ids),
            accepted_at=time.monotonic(),
        )
        if self.draining:
            reason: str | None = "draining"
        elif self.holds(job.request_id):
            # the same request offered again: the gateway re-offered after our answer came
            # late; the first acceptance stands (one job per request id, never two)
            reason = "duplicate request id"
        else:
            reason = self.batcher.offer(job, self.blocks.num_free_blocks)
        self.metrics.offer(reason is None)
        if reason is None:
            await self.send_gateway(Accept(request_id=job.request_id))
            self.work.set()
        else:
            await self.send_gateway(Reject(request_id=job.request_id, reason=reason))

    def _abort(self, rid: str) -> None:
        if self.batcher.remove(rid) is not None:
            return
        for job in self.batcher.running:
            if job.request_id == rid:
                job.aborted = True  # freed when the forward pass returns
                return
        held = self.handed_off.pop(rid, None)
        if held is not None:
            self._free(held)
            self.sender.abort(rid)

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            log.info("lease expired for %s: freeing its KV", rid)
            self._abort(rid)

    def _free(self, job: PrefillJob) -> None:
        if job.block_table:
            self.blocks.free(job.block_table)
            job.block_table = []
            self.work.set()  # blocks freed: a waiting batch may fit now

    # -- the engine loop -------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        while True:
            await self.work.wait()
            self.work.clear()
            while self.batcher.pending:
                batch = self.batcher.next_batch(self.blocks.num_free_blocks)
                if not batch:
                    break  # KV full of unacknowledged transfers: wait for an ack
                self.pass_over = asyncio.get_running_loop().create_future()
                try:
                    await self._run_batch(batch)
                finally:
                    self.pass_over.set_result(None)

    async def _run_batch(self, batch: list[PrefillJob]) -> None:
        for job in batch:
            job.block_table = self.blocks.allocate(self.batcher.blocks_for(job))
        started = time.monotonic()
        try:
            for job in batch:
                if job.params.max_tokens > 1:  # it will be handed off: decode reserves meanwhile
                    self.transfers[job.request_id] = self.sender.begin(
                        job.request_id,
                        job.decode,
                        job.prompt_ids,
                        job.num_prompt_tokens,
                        job.params,
                        job.block_table,
                    )
            loop = asyncio.get_running_loop()
            tokens, at_end = await self.run_engine(self._prefill, batch, loop)
        except Exception as exc:  # the batch fails, the node goes on: the gateway re-places it
            log.exception("prefill failed")
            self.batcher.batch_done()
            self.transfers.clear()
            for job in batch:
                self._free(job)
                self.sender.abort(job.request_id)
                await self.send_gateway(PrefillFailed(request_id=job.request_id, reason=repr(exc)))
            return
        prefill_s = time.monotonic() - started
        prefill_ms = prefill_s * 1000
        self.batcher.batch_done()
        for job in batch:
            self.metrics.queue_time.observe(started - job.accepted_at)
            self.metrics.prefill_time.observe(prefill_s)
            self.metrics.prompt_tokens.inc(job.num_prompt_tokens)
        for job, token in zip(batch, tokens, strict=True):
            transfer = self.transfers.pop(job.request_id, None)
            if transfer is not None and job.request_id in at_end:
                self.sender.push_all(transfer, at_end[job.request_id])
            reason = self._finish_reason(job, token)
            if job.aborted or reason is not None:
                self._free(job)
                self.sender.abort(job.request_id)
            if job.aborted:
                continue
            await self.send_gateway(
                FirstToken(
                    request_id=job.request_id,
                    token_id=token,
                    finish_reason=reason,
                    prefill_ms=prefill_ms,
                    queue_ms=(started - job.accepted_at) * 1000,
                )
            )
            if reason is None and transfer is not None:
                job.first_token = token
                self.handed_off[job.request_id] = job
                self.sender.done(transfer, token)

    def _finish_reason(self, job: PrefillJob, token: int) -> str | None:
        p = job.params
        if not p.ignore_eos and token in self.engine.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.max_tokens <= 1 or job.num_tokens + 1 >= self.engine.max_model_len:
            return "length"
        return None

    def _prefill(
        self, batch: list[PrefillJob], loop: asyncio.AbstractEventLoop
    ) -> tuple[list[int], dict[str, list[Any]]]:
        """Engine thread: one forward pass. Long prompts stream each layer as it lands (the
        send overlaps the next layers' compute); short ones, where per-layer framing costs
        more than it hides, are exported whole after the pass (`layerwise_min_tokens`)."""
        works = [PrefillWork(j.request_id, j.prompt_ids, 0, j.block_table, j.params) for j in batch]
        moving = [self.transfers[j.request_id] for j in batch if j.request_id in self.transfers]
        layerwise = [t for t in moving if t.num_tokens >= self.cfg.layerwise_min_tokens]

        def on_layer(layer: int) -> None:
            for t in layerwise:
                loop.call_soon_threadsafe(self.sender.push, t, layer, self.sender.stage(t, layer))

        tokens = self.engine.step(works, [], on_layer if layerwise else None)
        at_end = {t.request_id: self.sender.stage_all(t) for t in moving if t not in layerwise}
        return tokens, at_end

    # -- KV transfer callbacks -------------------------------------------------------------
    def _on_ack(self, t: Transfer) -> None:
        job = self.handed_off.pop(t.request_id, None)
        if job is None:
            return
        self._free(job)
        self.metrics.kv_sent(t.backend, t.total_bytes, t.finished - t.started)
        base = job.accepted_at
        record = KvTransferred(
            request_id=t.request_id,
            backend=t.backend,
            bytes=t.total_bytes,
            layerwise=t.num_tokens >= self.cfg.layerwise_min_tokens,
            start_ms=(t.started - base) * 1000,
            end_ms=(t.finished - base) * 1000,
        )
        self.spawn(self.send_gateway(record))

    async def _on_refuse(self, rid: str, peer: str, why: str) -> None:
        log.info("%s refused KV of %s: %s", peer, rid, why)
        await self.send_gateway(NeedDecode(request_id=rid, refused_by=peer, reason=why))

    async def _on_redirect(self, rid: str, target: DecodeTarget | None) -> None:
        while any(j.request_id == rid for j in self.batcher.running):
            # the pass still sends to the old peer: resend after it
            over = self.pass_over
            if over is not None and not over.done():
                await asyncio.shield(over)  # shielded: a cancelled redirect leaves it alone
            else:
                await asyncio.sleep(0.01)
        job = self.handed_off.get(rid)
        if job is None or job.first_token is None:
            return
        self.sender.release(rid)
        if target is None:  # nobody can take it: the gateway re-places the request
            self.handed_off.pop(rid, None)
            self._free(job)
            return
        job.decode = target
        t = self.sender.begin(
            rid, target, job.prompt_ids, job.num_prompt_tokens, job.params, job.block_table
        )
        # staging reads only this request's blocks: it need not wait behind the next forward
        # pass in the engine thread
        payloads = await asyncio.to_thread(self.sender.stage_all, t)
        if self.handed_off.get(rid) is not job:  # aborted meanwhile
            return
        self.sender.push_all(t, payloads)
        self.sender.done(t, job.first_token)
