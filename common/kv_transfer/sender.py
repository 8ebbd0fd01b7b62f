"""Prefill side of KV transfer: one ordered channel per decode peer, four backends.

`begin` sends the header (the decode node reserves blocks while we compute). `stage` runs in
the engine thread as each layer lands in the cache: it exports the layer as one contiguous
frame (ucx), hands out views of the cache itself (zmq, tcp: sent without a copy) or writes
it straight into the request's shared-memory segment (shm).
`push` (event loop) queues the layer's descriptor, and its frame or views, on the peer's
outbox; one sender task per peer keeps the order header, layers, done. The sender owns a
transfer until the decode node acknowledges it; `on_ack`/`on_refuse` report back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.interface import Engine
from pdserve.common.kv_transfer import choose_backend
from pdserve.common.kv_transfer.shm import Segment, SegmentPool
from pdserve.common.kv_transfer.tcp import TcpStream
from pdserve.common.protocol import (
    TO_PREFILL_DECODER,
    Abort,
    DecodeTarget,
    KvAck,
    KvDone,
    KvHeader,
    KvLayer,
    KvRefuse,
    encode,
)
from pdserve.common.sampling import SamplingParams
from pdserve.common.transport import decode_or_none, make_socket

log = logging.getLogger(__name__)
ACK_MAX_MSG = 1 << 20


@dataclass
class Transfer:
    request_id: str
    target: DecodeTarget
    backend: str
    block_table: list[int]
    num_tokens: int
    frame_bytes: int
    num_layers: int
    segment: Segment | None = None
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.frame_bytes * self.num_layers


@dataclass
class Peer:
    node_id: str
    sock: zmq.asyncio.Socket
    # (ZeroMQ parts, UCX frame, (request id, layer, TCP frame parts)) in send order
    outbox: asyncio.Queue[tuple[list[Any], Any, Any]] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    ucx_endpoint: Any = None
    tcp: TcpStream | None = None


class KvSender:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        node_id: str,
        host_id: str,
        engine: Engine,
        backend: str,
        on_ack: Callable[[Transfer], None],
        on_refuse: Callable[[str, str, str], Any],
    ) -> None:
        self.ctx = ctx
        self.node_id = node_id
        self.host_id = host_id
        self.engine = engine
        self.forced = backend
        self.on_ack = on_ack
        self.on_refuse = on_refuse
        self.num_layers = engine.model_config.num_layers
        self.peers: dict[str, Peer] = {}
        self.transfers: dict[str, Transfer] = {}
        self.pool = SegmentPool(node_id)

    # -- transfer lifecycle ----------------------------------------------------------------
    def begin(
        self,
        request_id: str,
        target: DecodeTarget,
        prompt_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_table: list[int],
    ) -> Transfer:
        backend = choose_backend(self.forced, self.host_id, target)
        n = len(prompt_ids)
        t = Transfer(
            request_id,
            target,
            backend,
            block_table,
            n,
            self.engine.kv_frame_bytes(n),
            self.num_layers,
        )
        if backend == "shm":
            t.segment = self.pool.take(t.total_bytes)
        self.transfers[request_id] = t
        header = KvHeader(
            request_id=request_id,
            prompt_ids=prompt_ids,
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            num_layers=self.num_layers,
            frame_bytes=t.frame_bytes,
            prefill_node=self.node_id,
            backend=backend,
            shm_name=t.segment.name if t.segment else "",
        )
        self._post(target, [encode(header)])
        return t

    def stage(self, t: Transfer, layer: int) -> Any:
        """Engine thread: the layer's frame (zmq/ucx), or None once it sits in shared memory."""
        if t.segment is not None:
            view = t.segment.view(layer * t.frame_bytes, t.frame_bytes)
            self.engine.export_into(layer, t.block_table, t.num_tokens, view)
            return None
        if t.backend in ("zmq", "tcp"):  # views of the cache itself: nothing copied to send
            return self.engine.export_parts(layer, t.block_table, t.num_tokens)
        return self.engine.export_frame(layer, t.block_table, t.num_tokens)

    def push(self, t: Transfer, layer: int, payload: Any) -> None:
        """Event loop: queue the layer (descriptor + frame) behind everything sent before."""
        if t.backend == "tcp":  # the frame carries its own head on the stream (tcp.py)
            self._post(t.target, [], tcp_payload=(t.request_id, layer, payload))
            return
        descriptor = encode(KvLayer(request_id=t.request_id, layer=layer))
        if t.backend == "zmq":
            self._post(t.target, [descriptor, *payload])
        elif t.backend == "ucx":
            self._post(t.target, [descriptor], ucx_payload=payload)
        else:
            self._post(t.target, [descriptor])

    def stage_all(self, t: Transfer) -> list[Any]:
        """Engine thread: every layer at once (short prompts, resends)."""
        return [self.stage(t, layer) for layer in range(self.num_layers)]

    def push_all(self, t: Transfer, payloads: list[Any]) -> None:
        for layer, payload in enumerate(payloads):
            self.push(t, layer, payload)

    def done(self, t: Transfer, first_token: int) -> None:
        self._post(t.target, [encode(KvDone(request_id=t.request_id, first_token_id=first_token))])

    def abort(self, request_id: str) -> None:
        """Tell the decode node to drop the reservation, and forget the transfer."""
        t = self.transfers.get(request_id)
        if t is not None:
            self._post(t.target, [encode(Abort(request_id=request_id))])
            self.release(request_id)

    def release(self, request_id: str) -> Transfer | None:
        t = self.transfers.pop(request_id, None)
        if t is not None and t.segment is not None:
            self.pool.give_back(t.segment)
            t.segment = None
        return t

    # -- peers -----------------------------------------------------------------------------
    def _post(
        self,
        target: DecodeTarget,
        parts: list[Any],
        ucx_payload: Any = None,
        tcp_payload: Any = None,
    ) -> None:
        peer = self.peers.get(target.node_id)
        if peer is None:
            sock = make_socket(
                self.ctx,
                "prefill.data",
                target.data_address,
                identity=self.node_id,
                max_msg=ACK_MAX_MSG,
            )
            peer = Peer(target.node_id, sock)
            peer.tasks = [
                asyncio.create_task(self._sender(peer, target)),
                asyncio.create_task(self._receiver(peer)),
            ]
            self.peers[target.node_id] = peer
        peer.outbox.put_nowait((parts, ucx_payload, tcp_payload))

    async def _sender(self, peer: Peer, target: DecodeTarget) -> None:
        while True:
            parts, ucx_payload, tcp_payload = await peer.outbox.get()
            try:
                await self._send_one(peer, target, parts, ucx_payload, tcp_payload)
            except Exception:  # one failed send must not stop this peer's channel
                log.exception("KV send to %s failed", peer.node_id)

    async def _send_one(
        self, peer: Peer, target: DecodeTarget, parts: list[Any], ucx_payload: Any, tcp_payload: Any
    ) -> None:
        if parts:
            await peer.sock.send_multipart(parts, copy=len(parts) == 1)
        if tcp_payload is not None:
            if peer.tcp is None:
                peer.tcp = TcpStream(target.tcp_address, self.node_id)
            try:
                await peer.tcp.send(*tcp_payload)
            except OSError as exc:  # the decode node sees the broken stream and refuses
                log.warning("KV stream to %s failed: %s", peer.node_id, exc)
        if ucx_payload is not None:
            if peer.ucx_endpoint is None:
                from pdserve.common.kv_transfer.ucx import connect

                peer.ucx_endpoint = await connect(target.ucx_address, self.node_id)
            await peer.ucx_endpoint.send(ucx_payload)

    async def _receiver(self, peer: Peer) -> None:
        while True:
            msg = decode_or_none(TO_PREFILL_DECODER, await peer.sock.recv())
            try:
                await self._on_reply(peer, msg)
            except Exception:
                log.exception("handling a reply from %s failed", peer.node_id)

    async def _on_reply(self, peer: Peer, msg: Any) -> None:
        match msg:
            case KvAck(request_id=rid):
                t = self.transfers.get(rid)
                if t is not None and t.target.node_id == peer.node_id:
                    self.release(rid)
                    t.finished = time.monotonic()
                    self.on_ack(t)
            case KvRefuse(request_id=rid, reason=why):
                t = self.transfers.get(rid)
                if t is not None and t.target.node_id == peer.node_id:
                    await self.on_refuse(rid, peer.node_id, why)
            case _:
                log.warning("dropping malformed message from %s", peer.node_id)

    async def close(self) -> None:
        for peer in self.peers.values():
            for task in peer.tasks:
                task.cancel()
            if peer.tcp is not None:
                peer.tcp.close()
            if peer.ucx_endpoint is not None:
                try:
                    await peer.ucx_endpoint.close()
                except Exception:  # the peer may be gone already
                    pass
            peer.sock.close()
        self.pool.close()
