"""Decode side of KV transfer: reservations, frames into the paged cache, acknowledgements.

A `KvHeader` asks `reserve` for blocks (a block table, or the reason to refuse, answered
with `KvRefuse`). Each `KvLayer` frame is scattered into those blocks: from ZeroMQ's receive
buffer (zmq), from the named shared-memory segment (shm), from the UCX endpoint's reused
buffer (ucx), or read straight into the blocks from the peer's TCP stream (tcp). `KvDone`
hands the complete request to `admit` and answers `KvAck`. A reservation whose frames stall
past `timeout` seconds is released and refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.engine.interface import Engine
from common.kv_transfer.shm import Segment, SegmentMaps
from common.protocol import (
    TO_DECODE_DECODER,
    Abort,
    KvAck,
    KvDone,
    KvHeader,
    KvLayer,
    KvRefuse,
    encode,
)
from common.transport import decode_or_none

log = logging.getLogger(__name__)


@dataclass
class Intake:
    header: KvHeader
    peer: bytes
    block_table: list[int]
    started: float = field(default_factory=time.monotonic)
    layers: set[int] = field(default_factory=set)
    segment: Segment | None = None
    bytes_in: int = 0
    dropped: bool = False  # refused or aborted; kept only to drain its UCX/TCP frames
    receiving: bool = False  # a TCP frame is landing in its blocks right now


class KvIntake:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        engine: Engine,
        reserve: Callable[[KvHeader], list[int] | str],
        release: Callable[[list[int]], None],
        admit: Callable[[Intake, int], Awaitable[None]],
        ucx: Any = None,
        timeout: float = 10.0,
        tcp: Any = None,
    ) -> None:
        self.sock = sock
        self.engine = engine
        self.reserve = reserve
        self.release = release
        self.admit = admit
        self.ucx = ucx
        self.tcp = tcp  # TcpListener
        self.timeout = timeout
        self.incoming: dict[str, Intake] = {}
        self.maps = SegmentMaps()

    async def run(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                await self.handle(parts)
            except Exception:
                log.exception("KV intake failed")

    async def handle(self, parts: list[zmq.Frame]) -> None:
        if len(parts) < 2:
            return
        peer = parts[0].bytes
        msg = decode_or_none(TO_DECODE_DECODER, parts[1].bytes)
        match msg:
            case KvHeader():
                reserved = self.reserve(msg)
                if isinstance(reserved, str):
                    if msg.backend in ("ucx", "tcp"):  # its frames still come: read, discard
                        self.incoming[msg.request_id] = Intake(msg, peer, [], dropped=True)
                    return await self.refuse(peer, msg.request_id, reserved)
                intake = Intake(msg, peer, reserved)
                self.incoming[msg.request_id] = intake
                if msg.backend == "shm":
                    try:
                        size = msg.frame_bytes * msg.num_layers
                        intake.segment = self.maps.get(msg.shm_name, size)
                    except (OSError, ValueError) as exc:
                        self.drop(msg.request_id)
                        return await self.refuse(peer, msg.request_id, f"shared memory: {exc}")
            case KvLayer(request_id=rid, layer=layer):
                frame = [p.buffer for p in parts[2:]] or None  # the frame, maybe in parts
                await self._on_layer(peer, rid, layer, frame)
            case KvDone(request_id=rid, first_token_id=token):
                done = self.incoming.pop(rid, None)
                if done is None or done.dropped:
                    return
                if len(done.layers) != done.header.num_layers:
                    self.release(done.block_table)
                    got = f"{len(done.layers)}/{done.header.num_layers}"
                    return await self.refuse(peer, rid, f"got {got} layers")
                await self.admit(done, token)
                await self.sock.send_multipart([peer, encode(KvAck(request_id=rid))])
            case Abort(request_id=rid):
                self.drop(rid)
                self.incoming.pop(rid, None)  # nothing more comes for it
            case _:
                log.warning("dropping malformed data message")

    async def _on_layer(self, peer: bytes, rid: str, layer: int, frame: Any) -> None:
        intake = self.incoming.get(rid)
        if intake is None:
            return
        h = intake.header
        size = h.frame_bytes
        if h.backend == "tcp":
            return await self._on_tcp_layer(intake, layer)
        if h.backend == "ucx":  # consume the peer's next frame even if we will drop it
            frame = await self.ucx.recv(h.prefill_node, size)
        elif h.backend == "shm" and intake.segment is not None:
            frame = intake.segment.view(layer * size, size)
        if isinstance(frame, list):
            got = sum(p.nbytes for p in frame)
        else:
            got = -1 if frame is None else len(frame)
        if intake.dropped or got != size or not 0 <= layer < h.num_layers:
            return
        self.engine.import_kv(layer, intake.block_table, len(h.prompt_ids), frame)
        intake.layers.add(layer)
        intake.bytes_in += size

    async def _on_tcp_layer(self, intake: Intake, layer: int) -> None:
        """Read the peer's next frame from its stream: in place into the reserved blocks
        where the cache allows it, else through a reused buffer (GPU cache, or a frame to
        discard because the request was dropped). Blocks dropped meanwhile are released only
        once the frame has landed, so no other sequence's KV is ever overwritten."""
        h = intake.header
        n = len(h.prompt_ids)
        wanted = not intake.dropped and 0 <= layer < h.num_layers
        views = self.engine.kv_targets(layer, intake.block_table, n) if wanted else None
        intake.receiving = True
        try:
            if views is not None:
                await asyncio.wait_for(self.tcp.recv_into(h.prefill_node, views), self.timeout)
            else:
                frame = await asyncio.wait_for(
                    self.tcp.recv(h.prefill_node, h.frame_bytes), self.timeout
                )
                if wanted and not intake.dropped:
                    self.engine.import_kv(layer, intake.block_table, n, frame)
        except (OSError, TimeoutError, asyncio.TimeoutError) as exc:
            log.warning("KV stream from %s failed: %r", h.prefill_node, exc)
            self.tcp.reset(h.prefill_node)
            if self.drop(h.request_id):
                await self.refuse(intake.peer, h.request_id, "KV stream failed")
        else:
            if not intake.dropped:
                intake.layers.add(layer)
                intake.bytes_in += h.frame_bytes
        finally:
            intake.receiving = False
            if intake.dropped and intake.block_table:  # dropped while its frame landed
                self.release(intake.block_table)
                intake.block_table = []

    async def refuse(self, peer: bytes, rid: str, reason: str) -> None:
        await self.sock.send_multipart([peer, encode(KvRefuse(request_id=rid, reason=reason))])

    def drop(self, rid: str) -> bool:
        """Release a reservation (abort, lease, timeout). A UCX or TCP transfer stays listed,
        dropped, so that its remaining frames are still taken off the stream in order."""
        intake = self.incoming.get(rid)
        if intake is None or intake.dropped:
            return False
        intake.dropped = True
        if not intake.receiving:  # else released when its frame has landed
            self.release(intake.block_table)
            intake.block_table = []
        if intake.header.backend not in ("ucx", "tcp"):
            del self.incoming[rid]
        return True

    @property
    def active(self) -> list[str]:
        return [rid for rid, i in self.incoming.items() if not i.dropped]

    async def expire(self, now: float) -> None:
        for rid, intake in list(self.incoming.items()):
            if intake.dropped and now - intake.started > 3 * self.timeout:
                del self.incoming[rid]  # its prefill node is gone too
            elif not intake.dropped and now - intake.started > self.timeout:
                log.warning(
                    "KV of %s stalled for %.1f s: freeing its reservation",
                    rid,
                    now - intake.started,
                )
                self.drop(rid)
                await self.refuse(intake.peer, rid, "KV transfer timed out")

    def close(self) -> None:
        self.maps.close()
