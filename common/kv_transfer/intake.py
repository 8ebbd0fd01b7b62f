"""Decode side of KV transfer: reservations, frames into the paged cache, acknowledgements.

A `KvHeader` asks `reserve` for blocks (a block table, or the reason to refuse, answered
with `KvRefuse`). Each layer's frame is put into those blocks: from ZeroMQ's receive buffer
(zmq, behind a `KvLayer` descriptor), from the named shared-memory segment (shm), from the
UCX endpoint's reused buffer (ucx), or read straight into the blocks by the peer's TCP stream
reader (tcp: frames carry their own head, see tcp.py, so they need no descriptor and may
arrive before the header; the reader waits a moment for it). A transfer is complete once it
has every layer and its `KvDone` (in either order: tcp frames and ZeroMQ messages travel on
different connections); then it goes to `admit` and the peer gets `KvAck`.

Leases: until its first frame, a reservation lives as long as the gateway knows the request
(the node's heartbeat lists it, the reply names stale ids); the prefill forward pass may take
any time. From its first frame on, a transfer that makes no progress for `timeout` seconds is
released and refused. Blocks dropped while a tcp frame lands in them are released only after
it has landed, so no other sequence's KV is ever overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.interface import Engine
from pdserve.common.kv_transfer.shm import Segment, SegmentMaps
from pdserve.common.protocol import (
    TO_DECODE_DECODER,
    Abort,
    KvAck,
    KvDone,
    KvHeader,
    KvLayer,
    KvRefuse,
    encode,
)
from pdserve.common.transport import decode_or_none

log = logging.getLogger(__name__)
CLOSED_MEMORY = 4096  # recently ended transfers whose late tcp frames are discarded at once


@dataclass
class Intake:
    header: KvHeader
    peer: bytes
    block_table: list[int]
    started: float = field(default_factory=time.monotonic)
    progress: float = 0.0  # last frame landed; 0 until the first
    layers: set[int] = field(default_factory=set)
    segment: Segment | None = None
    bytes_in: int = 0
    first_token: int | None = None  # from KvDone
    dropped: bool = False  # refused or aborted (ucx: kept only to drain its frames)
    receiving: bool = False  # a tcp frame is landing in its blocks right now
    scratch: bytearray | None = None  # tcp into a cache that cannot be written in place

    @property
    def complete(self) -> bool:
        return self.first_token is not None and len(self.layers) == self.header.num_layers


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
    ) -> None:
        self.sock = sock
        self.engine = engine
        self.reserve = reserve
        self.release = release
        self.admit = admit
        self.ucx = ucx
        self.timeout = timeout
        self.incoming: dict[str, Intake] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.arrivals: dict[str, asyncio.Event] = {}  # tcp frames waiting for their header
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
                await self._on_header(peer, msg)
            case KvLayer(request_id=rid, layer=layer):
                frame = [p.buffer for p in parts[2:]] or None  # the frame, maybe in parts
                await self._on_layer(peer, rid, layer, frame)
            case KvDone(request_id=rid, first_token_id=token):
                intake = self.incoming.get(rid)
                if intake is None or intake.peer != peer:
                    return
                if intake.dropped:
                    self._forget(rid)
                    return
                intake.first_token = token
                intake.progress = time.monotonic()  # from now on a stall is a failure
                if intake.complete:
                    await self._complete(intake)
                elif intake.header.backend != "tcp":  # tcp frames may still be on their way
                    got = f"{len(intake.layers)}/{intake.header.num_layers}"
                    self.drop(rid)
                    await self.refuse(peer, rid, f"got {got} layers")
            case Abort(request_id=rid):
                intake = self.incoming.get(rid)
                if intake is not None and intake.peer == peer:
                    self.drop(rid)
                    self._forget(rid)  # nothing more comes for it
            case _:
                log.warning("dropping malformed data message")

    async def _on_header(self, peer: bytes, h: KvHeader) -> None:
        rid = h.request_id
        if rid in self.incoming:  # never replace a live transfer's state
            return await self.refuse(peer, rid, "duplicate request id")
        reserved = self.reserve(h)
        if isinstance(reserved, str):
            if h.backend == "ucx":  # its frames still come, in order: read, discard
                self.incoming[rid] = Intake(h, peer, [], dropped=True)
            else:
                self._remember_closed(rid)
            return await self.refuse(peer, rid, reserved)
        intake = Intake(h, peer, reserved)
        self.incoming[rid] = intake
        self.closed.pop(rid, None)
        if h.backend == "shm":
            try:
                intake.segment = self.maps.get(h.shm_name, h.frame_bytes * h.num_layers)
            except (OSError, ValueError) as exc:
                self.drop(rid)
                return await self.refuse(peer, rid, f"shared memory: {exc}")
        event = self.arrivals.pop(rid, None)
        if event is not None:
            event.set()

    async def _on_layer(self, peer: bytes, rid: str, layer: int, frame: Any) -> None:
        intake = self.incoming.get(rid)
        if intake is None or intake.peer != peer or intake.header.backend == "tcp":
            return
        h = intake.header
        size = h.frame_bytes
        if h.backend == "ucx":  # consume the peer's next frame even if we will drop it
            try:
                frame = await asyncio.wait_for(self.ucx.recv(h.prefill_node, size), self.timeout)
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("UCX frame from %s failed: %r", h.prefill_node, exc)
                if self.drop(rid):
                    await self.refuse(peer, rid, "KV stream failed")
                return
        elif h.backend == "shm" and intake.segment is not None:
            frame = intake.segment.view(layer * size, size)
        if isinstance(frame, list):
            got = sum(p.nbytes for p in frame)
        else:
            got = -1 if frame is None else len(frame)
        if intake.dropped or got != size or not 0 <= layer < h.num_layers:
            return
        self.engine.import_kv(layer, intake.block_table, len(h.prompt_ids), frame)
        self._landed(intake, layer)

    def _landed(self, intake: Intake, layer: int) -> None:
        intake.layers.add(layer)
        intake.bytes_in += intake.header.frame_bytes
        intake.progress = time.monotonic()

    # -- the tcp stream reader's side (tcp.FrameSink) ----------------------------------------
    async def open_frame(
        self, peer: str, request_id: str, layer: int, nbytes: int
    ) -> Sequence[memoryview] | None:
        intake = self.incoming.get(request_id)
        if intake is None and request_id not in self.closed:
            # the header travels on ZeroMQ and may lag the frame: wait for it a moment
            event = self.arrivals.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self.timeout)
            except asyncio.TimeoutError:
                log.warning("KV frame of %s from %s came without a header", request_id, peer)
            finally:
                if self.arrivals.get(request_id) is event:
                    del self.arrivals[request_id]
            intake = self.incoming.get(request_id)
        if intake is None or intake.dropped or intake.header.prefill_node != peer:
            return None
        h = intake.header
        if nbytes != h.frame_bytes or not 0 <= layer < h.num_layers or layer in intake.layers:
            return None
        intake.receiving = True
        views = self.engine.kv_targets(layer, intake.block_table, len(h.prompt_ids))
        if views is not None:
            return views
        if intake.scratch is None or len(intake.scratch) < nbytes:
            intake.scratch = bytearray(nbytes)  # a cache that cannot be written in place
        return [memoryview(intake.scratch)[:nbytes]]

    async def frame_landed(self, peer: str, request_id: str, layer: int, ok: bool) -> None:
        intake = self.incoming.get(request_id)
        if intake is None:
            return
        intake.receiving = False
        if intake.dropped:  # dropped while its frame landed: the blocks are free now
            self._release(intake)
            self._forget(request_id)
            return
        if not ok:
            if self.drop(request_id):
                await self.refuse(intake.peer, request_id, "KV stream failed")
            return
        h = intake.header
        if intake.scratch is not None:
            frame = memoryview(intake.scratch)[: h.frame_bytes]
            self.engine.import_kv(layer, intake.block_table, len(h.prompt_ids), frame)
        self._landed(intake, layer)
        if intake.complete:
            await self._complete(intake)

    # -- endings ------------------------------------------------------------------------------
    async def _complete(self, intake: Intake) -> None:
        rid = intake.header.request_id
        del self.incoming[rid]
        self._remember_closed(rid)
        assert intake.first_token is not None
        await self.admit(intake, intake.first_token)
        await self.sock.send_multipart([intake.peer, encode(KvAck(request_id=rid))])

    async def refuse(self, peer: bytes, rid: str, reason: str) -> None:
        await self.sock.send_multipart([peer, encode(KvRefuse(request_id=rid, reason=reason))])

    def drop(self, rid: str) -> bool:
        """Release a reservation (abort, lease, stall). A UCX transfer stays listed, dropped,
        so that its remaining frames are still taken off the endpoint in order."""
        intake = self.incoming.get(rid)
        if intake is None or intake.dropped:
            return False
        intake.dropped = True
        if not intake.receiving:  # else released when its frame has landed
            self._release(intake)
            if intake.header.backend != "ucx":
                self._forget(rid)
        return True

    def _release(self, intake: Intake) -> None:
        if intake.block_table:
            self.release(intake.block_table)
            intake.block_table = []

    def _forget(self, rid: str) -> None:
        self.incoming.pop(rid, None)
        self._remember_closed(rid)

    def _remember_closed(self, rid: str) -> None:
        self.closed[rid] = None
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    @property
    def active(self) -> list[str]:
        return [rid for rid, i in self.incoming.items() if not i.dropped]

    async def expire(self, now: float) -> None:
        for rid, intake in list(self.incoming.items()):
            if intake.dropped:
                if now - intake.started > 3 * self.timeout:
                    del self.incoming[rid]  # a ucx transfer whose peer is gone too
                continue
            if intake.progress and now - intake.progress > self.timeout and not intake.receiving:
                log.warning(
                    "KV of %s stalled for %.1f s after %d/%d layers: freeing its reservation",
                    rid,
                    now - intake.progress,
                    len(intake.layers),
                    intake.header.num_layers,
                )
                self.drop(rid)
                await self.refuse(intake.peer, rid, "KV transfer timed out")

    def close(self) -> None:
        self.maps.close()
