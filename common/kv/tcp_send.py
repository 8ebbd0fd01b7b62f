"""Prefill side of the tcp KV stream: one connection per decode peer, written by a thread of
its own with blocking `sendmsg` (a frame's head and its views of the cache in one call).

The event loop queues a frame and goes on while fewer than `DEPTH` are queued or being
written: the thread always has the next frame when it finishes one, so the socket never
idles between layers. A transfer's KvDone (on ZeroMQ) waits for `flush`: its frames are
written before it goes, so none still reads blocks an abort freed. Written from the loop
with non-blocking sends, every few MB cost a wakeup and a Python callback (~250 sends per
524 MB transfer); awaiting a writer thread frame by frame left the socket idle for a
hand-off across threads per layer (benchmarks/kv_transfer.py, docs/results §11).

A failed frame is logged (rate-limited) and counted; the stream reconnects for the next one.
The decode node's reader sees the broken stream and refuses the transfer, or its lease runs
out; the prefill node learns it from that refusal, as before. A frame whose transfer ended
while it waited (aborted, refused) is not sent: its views may be another's by then."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.common.kv.tcp_wire import (
    HEAD,
    MAGIC,
    WireStats,
    closed_by_peer,
    recv_views,
    send_views,
    set_timeout,
)
from pdserve.common.node_id import ID_BYTES  # a stream opens with its sender's id, padded
from pdserve.common.wire.address import split_host_port
from pdserve.common.wire.security import NONCE_BYTES, ClusterKey

DEPTH = 2  # frames queued or being written per stream: one written, the next one ready
IDLE_S = 300.0  # a writer with nothing to send this long closes its stream and ends

log = logging.getLogger(__name__)


def frame_head(request_id: str, layer: int, nbytes: int) -> bytes:
    rid = request_id.encode()
    return HEAD.pack(MAGIC, layer, nbytes, len(rid)) + rid


@dataclass
class _Frame:
    head: bytes
    parts: Sequence[Any]
    loop: asyncio.AbstractEventLoop
    slots: asyncio.Semaphore  # given back once written, failed or skipped
    skip: Callable[[], bool] | None  # true: its transfer ended meanwhile


class TcpStream:
    """One connection to a decode peer, opened on first use, reopened after an error."""

    def __init__(
        self, address: str, node_id: str, key: ClusterKey | None = None, timeout: float = 10.0
    ) -> None:
        self.address = address
        self.endpoint = split_host_port(address)  # an IPv6 host unbracketed
        self.node_id = node_id
        self.key = key
        self.timeout = timeout
        self.sock: socket.socket | None = None  # the writer's; shut by close() under the lock
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()  # the writer's start, end and socket against close()
        self.writer: threading.Thread | None = None
        self.slots: asyncio.Semaphore | None = None
        self.closed = False
        self.failed = 0  # frames lost, in all
        self.warned_at = -1e9

    async def send(
        self,
        request_id: str,
        layer: int,
        parts: Sequence[Any],
        skip: Callable[[], bool] | None = None,
    ) -> None:
        """Queue a frame behind those before it, once fewer than DEPTH are ahead. Its views
        must stay valid until it is written, unless `skip()` says its transfer ended."""
        nbytes = sum(memoryview(p).nbytes for p in parts)  # what raises, before a slot
        if self.slots is None:
            self.slots = asyncio.Semaphore(DEPTH)
        loop = asyncio.get_running_loop()
        frame = _Frame(frame_head(request_id, layer, nbytes), parts, loop, self.slots, skip)
        await self.slots.acquire()
        self._put(frame)  # from here the writer (or `_give_back`) releases the slot

    async def flush(self) -> None:
        """Until every frame queued before this call is written or failed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._put(done)
        await done

    def _put(self, item: Any) -> None:
        with self.lock:
            if self.closed:
                _give_back([item])
                raise ConnectionError("the KV stream is closed")
            self.queue.put(item)
            if self.writer is not None:
                return
            writer = threading.Thread(
                target=self._write, name=f"kv-tcp-out-{self.address}", daemon=True
            )
            try:
                writer.start()  # the lock held: it cannot end before it is `self.writer`
            except RuntimeError:  # no thread to be had: nothing queued may wait for one
                _give_back(self._take_queued())
                raise ConnectionError("no thread to write the KV stream") from None
            self.writer = writer

    def _write(self) -> None:
        try:
            while self._write_next():
                pass
        except Exception:  # a bug: said here, and what it leaves queued is given back
            log.exception("the KV stream's writer to %s failed", self.address)
        finally:
            left: list[Any] = []
            with self.lock:
                if self.writer is threading.current_thread():  # not one started since
                    self.writer = None
                    self._disconnect()
                    left = self._take_queued()  # after a failure here: none may wait on
            _give_back(left)

    def _take_queued(self) -> list[Any]:
        left = []
        while True:
            try:
                left.append(self.queue.get_nowait())
            except queue.Empty:
                return left

    def _write_next(self) -> bool:
        """One item of the queue; False: the writer ends (closed, or idle for IDLE_S)."""
        try:
            item = self.queue.get(timeout=IDLE_S)
        except queue.Empty:
            with self.lock:  # idle: end, unless a frame came meanwhile (then `_put` saw a
                if not self.queue.empty():  # writer and started none)
                    return True
                self.writer = None
                self._disconnect()
                return False
        if item is None:
            return False
        if not isinstance(item, _Frame):  # a flush
            _done_soon(item.get_loop(), item.set_result, None)
            return True
        try:
            if not self.closed and not (item.skip is not None and item.skip()):
                self._write_frame(item)
        except OSError as exc:
            with self.lock:
                self._disconnect()  # the next frame starts a fresh stream
            self._failed(exc)
        except Exception:  # a bad frame must not end this peer's stream
            log.exception("KV frame to %s failed", self.address)
        finally:
            _done_soon(item.loop, item.slots.release)
        return True

    def _write_frame(self, frame: _Frame) -> None:
        if self.sock is not None and closed_by_peer(self.sock):
            with self.lock:  # the decode node shut it (idle, or it restarted): a fresh one
                self._disconnect()
        if self.sock is None:
            sock = self._connect()
            with self.lock:
                if self.closed:
                    sock.close()
                    return
                self.sock = sock
            if frame.skip is not None and frame.skip():  # ended while this connected
                return
        send_views(self.sock, [memoryview(frame.head), *(memoryview(p) for p in frame.parts)])

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.endpoint, timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # a decode node that stops reading (paused, partitioned: its window stays 0 or
            # nothing is acknowledged) fails the send, not stalls this peer's queue for good;
            # 3 x: its reader may wait `timeout` for a frame's header, not reading
            with contextlib.suppress(AttributeError, OSError):  # Linux only
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                int(3 * self.timeout * 1000))  # fmt: skip
            ident = self.node_id.encode()[:ID_BYTES].ljust(ID_BYTES)
            if self.key is not None:  # answer the decode node's challenge
                nonce = bytearray(NONCE_BYTES)
                set_timeout(sock, self.timeout)
                recv_views(sock, [memoryview(nonce)], WireStats())
                ident += self.key.mac(bytes(nonce), ident)
            set_timeout(sock, 3 * self.timeout)
            sock.sendall(ident)
        except BaseException:
            sock.close()
            raise
        return sock

    def _failed(self, exc: OSError) -> None:
        self.failed += 1
        now = time.monotonic()
        if not self.closed and now - self.warned_at >= 5.0:  # a dead peer fails every frame
            self.warned_at = now
            log.warning("KV frames to %s failed: %r (%d in all)", self.address, exc, self.failed)

    def _disconnect(self) -> None:
        """Lock held."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def retire(self) -> None:
        """The peer moved (a new endpoint): write what is queued, then end."""
        with self.lock:
            if self.writer is not None:
                self.queue.put(None)

    def close(self) -> None:
        """End the writer: frames still queued are dropped, one being written fails."""
        with self.lock:
            self.closed = True
            if self.writer is None:
                return
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # a blocked send returns at once
            self.queue.put(None)  # behind what is queued: each skipped, its waiters told


def _give_back(items: list[Any]) -> None:
    """Items no writer will take: their slots released, their flushes resolved."""
    for item in items:
        if isinstance(item, _Frame):
            _done_soon(item.loop, item.slots.release)
        elif isinstance(item, asyncio.Future):
            _done_soon(item.get_loop(), item.set_result, None)


def _done_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_call_unless_done, callback, *args)


def _call_unless_done(callback: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(asyncio.InvalidStateError):  # a flush cancelled meanwhile
        callback(*args)
