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
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.config import EngineConfig, NodeConfig
from common.engine.block_manager import BlockManager
from common.engine.interface import Engine, PrefillWork
from common.node import NodeBase
from common.protocol import (
    TO_PREFILL_DECODER,
    Abort,
    Accept,
    DecodeTarget,
    Drain,
    FirstToken,
    KvAck,
    KvDone,
    KvHeader,
    KvLayer,
    KvRefuse,
    Load,
    NeedDecode,
    PrefillFailed,
    PrefillOffer,
    Redirect,
    Reject,
    encode,
)
from common.tokenizer import Tokenizer
from common.transport import decode_or_none, make_socket
from prefill_node.batcher import PrefillBatcher, PrefillJob

log = logging.getLogger(__name__)


@dataclass
class Peer:
    """One DEALER to a decode node, with an ordered send queue."""

    node_id: str
    sock: zmq.asyncio.Socket
    outbox: asyncio.Queue[list[Any]] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)


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
        self.peers: dict[str, Peer] = {}
        self.handed_off: dict[str, PrefillJob] = {}  # KV sent or being sent, waiting for KvAck
        self.work = asyncio.Event()
        self.num_layers = engine.model_config.num_layers

    def data_address(self) -> str:
        return ""

    def load(self) -> Load:
        held = [j.request_id for j in (*self.batcher.pending, *self.batcher.running)]
        held += list(self.handed_off)
        return Load(
            running=len(self.batcher.running),
            waiting=len(self.batcher.pending),
            blocks_free=self.blocks.num_free_blocks - self.blocks.num_cached_blocks,
            blocks_cached=self.blocks.num_cached_blocks,
            blocks_in_use=self.blocks.num_in_use_blocks,
            held=tuple(held),
            draining=self.draining,
        )

    def idle(self) -> bool:
        return not (self.batcher.pending or self.batcher.running or self.handed_off)

    async def serve(self) -> None:
        self.tasks.append(asyncio.create_task(self._engine_loop()))
        await super().serve()

    def close_sockets(self) -> None:
        for peer in self.peers.values():
            for task in peer.tasks:
                task.cancel()
            peer.sock.close()

    # -- gateway messages ------------------------------------------------------------------
    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case PrefillOffer():
                await self._on_offer(msg)
            case Redirect(request_id=rid, decode=target):
                await self._on_redirect(rid, target)
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
        reason = (
            "draining" if self.draining else self.batcher.offer(job, self.blocks.num_free_blocks)
        )
        if reason is None:
            await self.send_gateway(Accept(request_id=job.request_id))
            self.work.set()
        else:
            await self.send_gateway(Reject(request_id=job.request_id, reason=reason))

    def _abort(self, rid: str) -> None:
        job = self.batcher.remove(rid)
        if job is not None:
            return
        for job in self.batcher.running:
            if job.request_id == rid:
                job.aborted = True  # freed when the forward pass returns
                return
        job = self.handed_off.pop(rid, None)
        if job is not None:
            self._free(job)
            self._to_peer(job.decode, [encode(Abort(request_id=rid))])

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
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[PrefillJob]) -> None:
        for job in batch:
            job.block_table = self.blocks.allocate(self.batcher.blocks_for(job))
            if job.params.max_tokens > 1:
                self._send_header(job)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            tokens = await self.run_engine(self._prefill, batch, loop)
        except Exception as exc:
            log.exception("prefill failed")
            for job in batch:
                self._free(job)
                await self.send_gateway(PrefillFailed(request_id=job.request_id, reason=repr(exc)))
            self.batcher.batch_done()
            return
        prefill_ms = (time.monotonic() - started) * 1000
        self.batcher.batch_done()
        for job, token in zip(batch, tokens, strict=True):
            reason = self._finish_reason(job, token)
            if job.aborted:
                self._free(job)
                self._to_peer(job.decode, [encode(Abort(request_id=job.request_id))])
                continue
            queue_ms = (started - job.accepted_at) * 1000
            await self.send_gateway(
                FirstToken(
                    request_id=job.request_id,
                    token_id=token,
                    finish_reason=reason,
                    prefill_ms=prefill_ms,
                    queue_ms=queue_ms,
                )
            )
            if reason is not None:
                self._free(job)
                if job.params.max_tokens > 1:
                    self._to_peer(job.decode, [encode(Abort(request_id=job.request_id))])
                continue
            job.first_token = token
            self.handed_off[job.request_id] = job
            self._to_peer(
                job.decode, [encode(KvDone(request_id=job.request_id, first_token_id=token))]
            )

    def _finish_reason(self, job: PrefillJob, token: int) -> str | None:
        p = job.params
        if not p.ignore_eos and token in self.engine.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.max_tokens <= 1 or job.num_tokens + 1 >= self.engine.max_model_len:
            return "length"
        return None

    def _prefill(self, batch: list[PrefillJob], loop: asyncio.AbstractEventLoop) -> list[int]:
        """Engine thread: one forward pass; each layer's frames are queued as they appear."""
        works = [PrefillWork(j.request_id, j.prompt_ids, 0, j.block_table, j.params) for j in batch]
        senders = [j for j in batch if j.params.max_tokens > 1]

        def on_layer(layer: int) -> None:
            for job in senders:
                frame = self.engine.export_frame(layer, job.block_table, job.num_tokens)
                header = encode(KvLayer(request_id=job.request_id, layer=layer))
                loop.call_soon_threadsafe(self._to_peer, job.decode, [header, frame])

        return self.engine.step(works, [], on_layer if senders else None)

    # -- KV transfer -----------------------------------------------------------------------
    def _send_header(self, job: PrefillJob) -> None:
        header = KvHeader(
            request_id=job.request_id,
            prompt_ids=job.prompt_ids,
            num_prompt_tokens=job.num_prompt_tokens,
            params=job.params,
            num_layers=self.num_layers,
            frame_bytes=self.engine.kv_frame_bytes(job.num_tokens),
            prefill_node=self.node_id,
        )
        self._to_peer(job.decode, [encode(header)])

    def _to_peer(self, target: DecodeTarget, parts: list[Any]) -> None:
        peer = self.peers.get(target.node_id)
        if peer is None:
            sock = make_socket(self.ctx, "prefill.data", target.data_address, identity=self.node_id)
            peer = Peer(target.node_id, sock)
            peer.tasks = [
                asyncio.create_task(self._peer_sender(peer)),
                asyncio.create_task(self._peer_receiver(peer)),
            ]
            self.peers[target.node_id] = peer
        peer.outbox.put_nowait(parts)

    async def _peer_sender(self, peer: Peer) -> None:
        while True:
            parts = await peer.outbox.get()
            await peer.sock.send_multipart(parts, copy=len(parts) == 1)

    async def _peer_receiver(self, peer: Peer) -> None:
        while True:
            msg = decode_or_none(TO_PREFILL_DECODER, await peer.sock.recv())
            match msg:
                case KvAck(request_id=rid):
                    job = self.handed_off.pop(rid, None)
                    if job is not None:
                        self._free(job)
                case KvRefuse(request_id=rid, reason=why):
                    log.info("%s refused KV of %s: %s", peer.node_id, rid, why)
                    await self.send_gateway(
                        NeedDecode(request_id=rid, refused_by=peer.node_id, reason=why)
                    )
                case _:
                    log.warning("dropping malformed message from %s", peer.node_id)

    async def _on_redirect(self, rid: str, target: DecodeTarget | None) -> None:
        job = self.handed_off.get(rid) or next(
            (j for j in self.batcher.running if j.request_id == rid), None
        )
        if job is None:
            return
        if target is None:
            self.handed_off.pop(rid, None)
            self._free(job)
            return
        while any(j is job for j in self.batcher.running):
            await asyncio.sleep(0.001)  # the pass still sends to the old peer; resend after it
        if rid not in self.handed_off or job.first_token is None:
            return
        job.decode = target
        self._send_header(job)
        frames = await self.run_engine(
            lambda: [
                self.engine.export_frame(i, job.block_table, job.num_tokens)
                for i in range(self.num_layers)
            ]
        )
        for layer, frame in enumerate(frames):
            self._to_peer(target, [encode(KvLayer(request_id=rid, layer=layer)), frame])
        self._to_peer(target, [encode(KvDone(request_id=rid, first_token_id=job.first_token))])
