"""Raw TCP payload channel: frames go from the prefill node's paged cache to the decode node's
paged cache with one kernel copy on each side. (libzmq receives into buffers of its own: one
more copy, which on few cores competes with the transfer; benchmarks/kv_transfer.py.) The
decode node reads each frame straight into the request's reserved blocks (one view per run
of consecutive slots, KVCache.kv_targets); the prefill node sends views of its cache.

The stream is self-describing: a prefill node opens one connection per decode peer, sends its
node id (64 bytes, space padded; with --cluster-key the decode node first sends a nonce and
the id is followed by HMAC(key, nonce + id), checked before anything else is read), then
frames, each behind a head naming its request, layer and length (`HEAD` + the request id).
Each side gives every connection a thread of its own (tcp_wire: blocking reads, one system
call per frame; tcp_send: blocking writes of a queue of frames). The decode node's reader asks
a `FrameSink` (landing.py) where each frame goes, from its thread without waiting for the
event loop while the transfer's header has come: into reserved blocks, or nowhere (unknown,
refused or dropped transfers: read and discarded). So
the stream never falls out of step with the transfers, and one stalled or broken peer holds
up no other. A frame stalled for `timeout`, a bad head or a closed connection ends the
stream; the transfer whose frame was landing fails, and the peer reconnects for its next
frame. A full listener (MAX_READERS) shuts one in its handshake, else the stream idle
longest (never one mid-frame: a head read as it is picked is claimed nowhere, its transfer
refused); a sender finds it closed and reconnects."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

from pdserve.common.kv.base import Backend, Intake, Local, ReceiveConnector, SendConnector, Transfer
from pdserve.common.kv.landing import ASK_LOOP, FrameSink
from pdserve.common.kv.tcp_send import TcpStream, frame_head
from pdserve.common.kv.tcp_wire import (
    HEAD,
    MAGIC,
    Closed,
    WireStats,
    recv_views,
    set_timeout,
    shut,
)
from pdserve.common.logs import Every
from pdserve.common.node_id import ID_BYTES  # a stream opens with its sender's id, padded
from pdserve.common.wire.address import EVERYWHERE, host_port, listening_socket
from pdserve.common.wire.security import MAC_BYTES, REFUSALS, ClusterKey, new_nonce

__all__ = ["ID_BYTES", "TcpListener", "TcpStream", "frame_head"]

MAX_ID = 512
CHUNK = 1 << 20  # discarded payloads are read through a buffer of this size
MAX_READERS = 256  # connections read at once (a thread each): past it, the idlest is shut
HANDSHAKE_S = 10.0  # a connection's whole handshake (its id, its tag), at most

log = logging.getLogger(__name__)


class TcpListener:
    """Decode side: accepts prefill connections and reads each one in its own thread."""

    def __init__(
        self,
        advertise_host: str,
        port: int = 0,
        timeout: float = 10.0,
        max_frame: int = 1 << 40,
        key: ClusterKey | None = None,
        listen: str = EVERYWHERE,
    ) -> None:
        self.key = key
        self.sock = listening_socket(listen, port)  # EVERYWHERE: IPv4 and IPv6
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.address = host_port(advertise_host, self.sock.getsockname()[1])
        self.timeout = timeout
        self.max_frame = max_frame
        self.sink: FrameSink | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.conns: dict[str, socket.socket] = {}
        # streams between frames or still in their handshake, since when: the ones shut to
        # make room when the listener is full (one mid-frame never is)
        self.idle: dict[socket.socket, float] = {}
        self.unproven: set[socket.socket] = set()  # in their handshake: shut first when full
        self.lock = threading.Lock()  # conns, idle: reader threads and close()
        self.stats = WireStats()
        self.readers = 0  # reader threads alive (counted on the event loop)
        self.full_said, self.accept_said = Every(10.0), Every(10.0)  # a flood: one line each
        self.closing = False
        self.accepting: asyncio.Task | None = None

    def start(self, sink: FrameSink) -> None:
        self.sink = sink
        self.loop = asyncio.get_running_loop()
        self.accepting = asyncio.ensure_future(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError as exc:  # out of file descriptors, say: try again shortly
                if self.accept_said.due():
                    log.warning("KV listener cannot accept: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if self.readers >= MAX_READERS and not self._shut_idlest():
                conn.close()
                if self.full_said.due():
                    log.warning("KV listener full (%d streams): refused %s", MAX_READERS, addr)
                continue
            name = f"kv-tcp-in-{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "kv-tcp-in"
            counted = False
            try:  # no thread to be had (or a socket gone at once): this one closed, not the loop
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_timeout(conn, self.timeout)
                reader = threading.Thread(target=self._serve, args=(conn, addr), name=name,
                                          daemon=True)  # fmt: skip
                with self.lock:
                    self.idle[conn] = time.monotonic()
                    self.unproven.add(conn)
                self.readers, counted = self.readers + 1, True
                reader.start()
            except (OSError, RuntimeError) as exc:
                log.warning("KV listener cannot serve %s: %r", addr, exc)
                self.readers -= counted
                with self.lock:
                    self.idle.pop(conn, None)
                    self.unproven.discard(conn)
                conn.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a sink call on the event loop and wait for it (reader thread)."""
        assert self.loop is not None
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as exc:  # the loop is closed: the node is going
            coro.close()
            raise ConnectionError("the node is closing") from exc
        while True:
            try:
                return fut.result(0.5)
            except concurrent.futures.TimeoutError:
                if self.closing or self.loop.is_closed():
                    fut.cancel()
                    raise ConnectionError("the node is closing") from None
            except concurrent.futures.CancelledError:  # the loop is shutting its tasks down
                raise ConnectionError("the node is closing") from None

    def _shut_idlest(self) -> bool:
        """Full: shut the stream idle longest, so that connections that handshake slowly or
        send an id and then nothing (any peer, without a cluster key) cannot lock senders
        out; a sender whose idle stream was shut reconnects for its next frame (TcpStream)."""
        with self.lock:
            if not self.idle:
                return False
            # a connection in its handshake first: keyless peers pushed proven streams off
            pool = [c for c in self.idle if c in self.unproven] or self.idle
            victim = min(pool, key=self.idle.__getitem__)
            del self.idle[victim]
        shut(victim)
        return True

    def _serve(self, conn: socket.socket, addr: Any = None) -> None:
        try:
            self._serve_conn(conn, addr)
        finally:
            with self.lock:
                self.idle.pop(conn, None)
                self.unproven.discard(conn)
            try:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self._reader_gone)
            except RuntimeError:
                pass  # the loop is closed: nobody counts any more

    def _reader_gone(self) -> None:
        self.readers -= 1

    def _serve_conn(self, conn: socket.socket, addr: Any) -> None:
        ident = bytearray(ID_BYTES + (MAC_BYTES if self.key else 0))
        # the whole handshake in a deadline (a byte every few seconds held a reader for long)
        deadline = threading.Timer(min(self.timeout, HANDSHAKE_S), shut, (conn,))
        try:
            deadline.start()  # RuntimeError: no thread to be had, the connection closed
            if self.key is not None:
                nonce = new_nonce()
                conn.sendall(nonce)
            recv_views(conn, [memoryview(ident)], self.stats)
        except (OSError, RuntimeError):
            conn.close()
            return
        finally:
            deadline.cancel()
        if self.key is not None and not self.key.check(
            bytes(ident[ID_BYTES:]), nonce, bytes(ident[:ID_BYTES])
        ):
            REFUSALS.refuse(
                "kv-stream", "a tcp KV connection from %s without the cluster key", addr
            )
            conn.close()
            return
        peer = ident[:ID_BYTES].decode(errors="replace").strip()
        with self.lock:
            self.unproven.discard(conn)
            old = self.conns.pop(peer, None)
            self.conns[peer] = conn
        if old is not None:
            shut(old)  # the peer reconnected: its old stream is over
        try:
            self._read_frames(peer, conn)
        except (OSError, ValueError) as exc:
            if not self.closing:
                log.warning("KV stream from %s ended: %r", peer, exc)
        except Exception:  # a sink bug: this stream ends, the node and other streams go on
            log.exception("KV stream from %s failed", peer)
        finally:
            with self.lock:
                if self.conns.get(peer) is conn:
                    del self.conns[peer]
            conn.close()

    def _read_frames(self, peer: str, conn: socket.socket) -> None:
        assert self.sink is not None
        head = bytearray(HEAD.size)
        while not self.closing:
            with self.lock:
                self.idle[conn] = time.monotonic()
            try:
                recv_views(conn, [memoryview(head)], self.stats, idle_ok=True)  # no deadline
            except Closed:
                return  # between frames: the sender ended its stream (idle, or going)
            with self.lock:  # out of `idle` before claiming: else taken to be shut (_shut_idlest)
                evicted = self.idle.pop(conn, None) is None
            magic, layer, nbytes, id_len = HEAD.unpack(head)
            if magic != MAGIC or id_len > MAX_ID or nbytes > self.max_frame:
                raise ValueError(f"not a KV frame head: {bytes(head)!r}")
            rid_bytes = bytearray(id_len)
            recv_views(conn, [memoryview(rid_bytes)], self.stats)
            rid = rid_bytes.decode(errors="replace")
            if evicted:  # shut any moment now: nothing claimed, and its transfer told at once
                self._post(self.sink.frame_lost(peer, rid))
                return
            views = self.sink.claim_frame(peer, rid, layer, nbytes)
            claimed = views is not ASK_LOOP  # then landed here too, no round trip to the loop
            if not claimed:
                views = self._call(self.sink.open_frame(peer, rid, layer, nbytes))
            try:
                if views is None:
                    self._discard(conn, nbytes)
                else:
                    recv_views(conn, views, self.stats)
            except Exception:
                if views is not None:
                    self._call(self.sink.frame_landed(peer, rid, layer, False))
                raise
            if views is None:
                continue
            if claimed:
                self._post(self.sink.frame_written(peer, rid, layer))
            else:
                self._call(self.sink.frame_landed(peer, rid, layer, True))

    def _post(self, coro: Coroutine[Any, Any, Any] | None) -> None:
        """Run a sink call on the event loop without waiting for it (reader thread)."""
        if coro is None or self.loop is None:
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: the node is going
            coro.close()
            return
        fut.add_done_callback(_log_failure)

    def _discard(self, conn: socket.socket, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, CHUNK)))
        while nbytes:
            n = min(nbytes, len(scratch))
            recv_views(conn, [scratch[:n]], self.stats)
            nbytes -= n

    async def close(self) -> None:
        self.closing = True
        if self.accepting is not None:
            self.accepting.cancel()
        with self.lock:
            conns = list(self.conns.values())
        for conn in conns:
            shut(conn)  # wakes its reader, which closes it
        self.sock.close()


def _log_failure(fut: concurrent.futures.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("landing a KV frame failed", exc_info=fut.exception())


class TcpSend(SendConnector):
    """A stream per decode node and endpoint: a node restarted on another port gets a new
    one while transfers begun before still name the old (their frames fail there, as their
    transfers must); two at most per node, the one used least recently retired (it writes
    what it holds, then ends). One stream per node, switched at each change, ping-ponged
    between the two and each reconnect made the listener shut the stream before it."""

    KEEP = 2  # endpoints per decode node

    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.streams: dict[tuple[str, str], TcpStream] = {}  # by decode node id, endpoint

    def descriptor(self, t: Transfer, layer: int, payload: Any) -> list[Any] | None:
        return None  # the stream is self-describing: no KvLayer messages

    async def send(self, t: Transfer, layer: int, payload: Any) -> None:
        key = (t.target.node_id, t.target.kv_endpoints["tcp"])
        stream = self.streams.pop(key, None)  # back in last: the most recently used
        if stream is None:
            stream = TcpStream(key[1], self.local.node_id, self.local.key, self.local.timeout)
            same = [k for k in self.streams if k[0] == key[0]]
            for old in same[: max(0, len(same) - self.KEEP + 1)]:
                self.streams.pop(old).retire()
        self.streams[key] = stream
        t.state = stream  # its frames' stream, retired or not: `settle` flushes that one
        await stream.send(t.request_id, layer, payload, skip=lambda: t.ended is not None)

    async def settle(self, t: Transfer) -> None:
        stream = t.state
        if isinstance(stream, TcpStream):
            with contextlib.suppress(ConnectionError):  # closed: nothing of it is written
                await stream.flush()

    async def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


class TcpReceive(ReceiveConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        kv = local.kv
        max_frame = kv.frame_bytes(local.max_tokens or kv.num_blocks * kv.block_size) + 4096
        ours = (local.ports.get("tcp", 0), local.timeout, max_frame, local.key, local.listen)
        self.listener = TcpListener(local.advertise_host, *ours)

    async def listen(self, sink: Any) -> str:
        self.listener.start(sink)  # the intake lands the frames (FrameSink)
        return self.listener.address

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        """A tcp transfer's frames come on its stream, never as ZeroMQ parts: one that
        does is dropped (landed beside a stream frame, it could complete the transfer while
        that frame still writes into the blocks)."""
        return None

    async def close(self) -> None:
        await self.listener.close()


CONNECTOR = Backend("tcp", TcpSend, TcpReceive, auto_rank=1)
