"""Raw TCP payload channel: frames go from the prefill node's paged cache to the decode node's
paged cache with one kernel copy on each side, as a plain socket moves bytes.

Why not only ZeroMQ: libzmq receives into message buffers it allocates, so a ZeroMQ frame
costs one more copy (its buffer into the cache) than a socket read straight into the cache;
on a machine with few cores that copy competes with the transfer itself
(benchmarks/kv_transfer.py). Here the decode node reads each frame with `recv_into` directly
into the request's reserved blocks (one view per run of consecutive slots, see
KVCache.export_parts), and the prefill node sends views of its cache.

Control stays on ZeroMQ, as with UCX: a prefill node opens one connection per decode peer and
first sends its node id (64 bytes, space padded); frames then follow in exactly the order of
their KvLayer descriptors on the ZeroMQ channel, so the decode node, handling a descriptor,
reads the next frame of that peer's stream. A stream that breaks or stalls is closed; the
transfers on it fail and are refused, and the peer reconnects for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import Any

ID_BYTES = 64

log = logging.getLogger(__name__)


async def _fill(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("the KV stream closed mid-frame")
        got += n


class TcpListener:
    """Decode side: accepts prefill connections and reads their frames on request."""

    def __init__(self, advertise_host: str, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.address = f"{advertise_host}:{self.sock.getsockname()[1]}"
        self.conns: dict[str, socket.socket] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.scratch = bytearray(0)
        self.task: asyncio.Task | None = None
        self.greeting: set[asyncio.Task] = set()

    def start(self) -> None:
        self.task = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._greet(conn))
            self.greeting.add(task)
            task.add_done_callback(self.greeting.discard)

    async def _greet(self, conn: socket.socket) -> None:
        ident = bytearray(ID_BYTES)
        try:
            await asyncio.wait_for(_fill(conn, memoryview(ident)), 10)
        except (OSError, TimeoutError, asyncio.TimeoutError):
            conn.close()
            return
        peer = ident.decode(errors="replace").strip()
        old = self.conns.pop(peer, None)
        if old is not None:
            old.close()
        self.conns[peer] = conn
        self.arrived.setdefault(peer, asyncio.Event()).set()

    async def recv_into(self, peer: str, views: Sequence[memoryview]) -> None:
        """Fill `views` in order with the next frame of `peer`'s stream."""
        await self.arrived.setdefault(peer, asyncio.Event()).wait()
        conn = self.conns[peer]
        for view in views:
            await _fill(conn, view)

    async def recv(self, peer: str, size: int) -> memoryview:
        """The next frame of `peer` in a buffer reused across frames (valid until the next
        call): for caches that cannot be written in place (GPU) and frames to discard."""
        if len(self.scratch) < size:
            self.scratch = bytearray(size)
        view = memoryview(self.scratch)[:size]
        await self.recv_into(peer, [view])
        return view

    def reset(self, peer: str) -> None:
        """The stream is out of step (broken, stalled): close it; the peer reconnects."""
        conn = self.conns.pop(peer, None)
        if conn is not None:
            conn.close()
        event = self.arrived.get(peer)
        if event is not None:
            event.clear()

    async def close(self) -> None:
        for task in (self.task, *self.greeting):
            if task is not None:
                task.cancel()
        for conn in self.conns.values():
            conn.close()
        self.sock.close()


class TcpStream:
    """Prefill side: one connection to a decode peer, opened on first use, reopened after
    an error."""

    def __init__(self, address: str, node_id: str) -> None:
        host, _, port = address.rpartition(":")
        self.endpoint = (host, int(port))
        self.node_id = node_id
        self.sock: socket.socket | None = None

    async def send(self, parts: Sequence[Any]) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, self.endpoint)
                self.sock = sock
                ident = self.node_id.encode()[:ID_BYTES].ljust(ID_BYTES)
                await loop.sock_sendall(sock, ident)
            for part in parts:
                await loop.sock_sendall(self.sock, part)
        except OSError:
            self.close()  # the next frame starts a fresh stream
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
