"""The tcp KV stream reads a frame straight into its targets in a bounded number of system
calls, however scattered the targets: the check that fails if a per-chunk read, a per-block
read or an intermediate copy comes back (issue 30). Real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdserve.common.kv import tcp, tcp_send
from pdserve.common.kv.landing import ASK_LOOP
from pdserve.common.kv.tcp import TcpListener, TcpStream
from tests.component.cluster import until  # waits on the listener's own state, not on time

FRAMES = 8
FRAME = 4 << 20  # 32 MiB in all: many socket buffers' worth
RUN = 16 << 10  # scattered targets: one view per 16 KiB, as a fragmented block table gives


class Sink:
    """Targets for every frame: `RUN`-sized views of one arena, in reverse order. Claimed in
    the reader thread (as the intake's are), or, `threaded` False, opened on the loop (as a
    frame that came before its header or lands in a scratch buffer is)."""

    def __init__(self, threaded: bool = True) -> None:
        self.threaded = threaded
        self.arena = bytearray(FRAMES * FRAME)
        self.landed: list[tuple[str, int, bool]] = []
        self.done = asyncio.Event()

    def views(self, layer: int) -> list[memoryview]:
        base = memoryview(self.arena)[layer * FRAME : (layer + 1) * FRAME]
        runs = [base[i : i + RUN] for i in range(0, FRAME, RUN)]
        return runs[::-1]  # each run apart from the one before it in frame order

    async def open_frame(
        self, peer: str, request_id: str, layer: int, nbytes: int
    ) -> Sequence[memoryview] | None:
        return self.views(layer) if request_id == "big" and nbytes == FRAME else None

    async def frame_landed(self, peer: str, request_id: str, layer: int, ok: bool) -> None:
        self.landed.append((request_id, layer, ok))
        if len(self.landed) == FRAMES:
            self.done.set()

    def claim_frame(self, peer: str, request_id: str, layer: int, nbytes: int) -> Any:
        if not self.threaded:
            return ASK_LOOP
        return self.views(layer) if request_id == "big" and nbytes == FRAME else None

    def frame_written(
        self, peer: str, request_id: str, layer: int
    ) -> Coroutine[Any, Any, None] | None:
        return self.frame_landed(peer, request_id, layer, True)  # on the loop, not waited for


def payload(layer: int) -> np.ndarray:
    return (np.arange(FRAME, dtype=np.uint32) * 2654435761 + layer).astype(np.uint8)


@pytest.mark.parametrize("threaded", [True, False], ids=["claimed-in-thread", "opened-on-loop"])
async def test_scattered_frames_land_in_few_receives(threaded: bool) -> None:
    sink = Sink(threaded)
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    waits = []  # the reader's round trips to the event loop: none when it claims itself
    call = listener._call
    listener._call = lambda coro: waits.append(1) or call(coro)  # type: ignore[method-assign]
    stream = TcpStream(listener.address, "p")
    try:
        await stream.send("junk", 0, [memoryview(b"x" * 1000)])  # discarded, then in step
        for layer in range(FRAMES):
            await stream.send("big", layer, [memoryview(payload(layer))])
        await asyncio.wait_for(sink.done.wait(), 60)
    finally:
        stream.close()
        await listener.close()
    assert sink.landed == [("big", layer, True) for layer in range(FRAMES)]
    assert len(waits) == (0 if threaded else 2 * FRAMES + 1)  # open + landed, junk's open
    for layer in range(FRAMES):  # byte-exact, each run where its view said
        got = b"".join(bytes(v) for v in sink.views(layer)[::-1])
        assert got == payload(layer).tobytes()
    # Per frame: its head, its request id and its payload, one receive each with MSG_WAITALL
    # (256 views fit one recvmsg); the discarded frame 3. A kernel may end a MSG_WAITALL
    # read early on a signal or a receive timeout, hence the allowance of one more per
    # frame. Reading per socket buffer (~64-256 KiB) would take 16-64 per frame, per view
    # 256: either fails here.
    frames = FRAMES + 1
    assert listener.stats.recv_calls <= 4 * frames, listener.stats
    assert listener.stats.recv_bytes >= FRAMES * FRAME


async def test_a_flood_of_idle_connections_makes_room_for_a_sender(monkeypatch) -> None:
    """Each stream is read by a thread: past MAX_READERS open connections the listener
    refused new ones, so connections that send an id and then nothing (any peer, without a
    cluster key) or handshake a byte at a time locked every sender out. Now the idlest is
    shut and the sender served; a connection mid-frame is never the one shut."""

    monkeypatch.setattr(tcp, "MAX_READERS", 3)
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    host, port = "127.0.0.1", int(listener.address.rpartition(":")[2])
    idle = [socket.create_connection((host, port)) for _ in range(2)]
    idle[1].sendall(b"x".ljust(tcp.ID_BYTES))  # a stream with an id, then silence
    busy = socket.create_connection((host, port))  # one mid-frame: a head, part of a frame
    busy.sendall(b"busy".ljust(tcp.ID_BYTES) + tcp.frame_head("big", 1, FRAME) + b"\0" * 1024)

    try:
        await until(lambda: listener.readers == 3 and len(listener.idle) == 2)
        stream = TcpStream(listener.address, "p")
        await stream.send("big", 0, [memoryview(payload(0))])
        await until(lambda: ("big", 0, True) in sink.landed)
        idle[0].settimeout(5)
        assert await asyncio.to_thread(idle[0].recv, 1) == b""  # the idlest, shut
        with pytest.raises(BlockingIOError):  # the one mid-frame: still open (no EOF)
            busy.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        stream.close()
    finally:
        for s in [*idle, busy]:
            s.close()
        await listener.close()


async def test_a_sender_whose_idle_stream_was_shut_reconnects_for_its_next_frame() -> None:
    """The listener shuts idle streams when full (or the decode node restarted): the sender
    wrote its next frame into the closed stream and it was lost (its transfer failed)."""
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    stream = TcpStream(listener.address, "p")
    try:
        await stream.send("big", 0, [memoryview(payload(0))])
        for _ in range(500):
            if sink.landed:
                break
            await asyncio.sleep(0.01)
        with listener.lock:
            [conn] = listener.conns.values()
        tcp.shut(conn)  # what a full listener does to an idle stream
        for _ in range(500):  # the reader saw it end
            if not listener.conns:
                break
            await asyncio.sleep(0.01)
        await stream.send("big", 1, [memoryview(payload(1))])
        for _ in range(500):
            if len(sink.landed) == 2:
                break
            await asyncio.sleep(0.01)
        assert sink.landed == [("big", 0, True), ("big", 1, True)]
    finally:
        stream.close()
        await listener.close()


async def test_a_decode_node_that_stops_reading_fails_the_send_not_stalls_it_for_good() -> None:
    """A decode node that accepts and then reads nothing (a paused container, a partition:
    its window stays 0 or nothing is acknowledged) stalled the sender's sendall forever, and
    with it everything queued behind it for that peer, Aborts included."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    stream = TcpStream(f"127.0.0.1:{srv.getsockname()[1]}", "p", timeout=0.5)
    # far more than both ends' socket buffers hold (Linux's tcp_wmem and tcp_rmem maxima:
    # 4 and 6 MiB by default, 32 MiB on some hosts)
    big = memoryview(bytes(128 << 20))
    try:
        started = asyncio.get_running_loop().time()
        await stream.send("big", 0, [big])  # queued: the stream's thread writes it
        await asyncio.wait_for(stream.flush(), 20)  # wait_for's TimeoutError: stalled for good
        assert stream.failed == 1, "the send completed into a peer that reads nothing"
        # 3 x the timeout without progress (SO_SNDTIMEO, TCP_USER_TIMEOUT), plus probing
        assert asyncio.get_running_loop().time() - started < 15
    finally:
        stream.close()
        srv.close()


async def test_connections_in_their_handshake_go_before_a_proven_stream(monkeypatch) -> None:
    """A full listener shut the connection idle longest, whether in its handshake or a
    proven stream between frames: peers without the key, opening connections, pushed the
    cluster's own streams off, one per connect. And a handshake has a deadline of its own
    (the receive timeout restarts at each byte)."""
    monkeypatch.setattr(tcp, "MAX_READERS", 3)
    monkeypatch.setattr(tcp, "HANDSHAKE_S", 1.0)
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    host, port = "127.0.0.1", int(listener.address.rpartition(":")[2])
    stream = TcpStream(listener.address, "p")
    silent: list[socket.socket] = []

    try:
        await stream.send("big", 0, [memoryview(payload(0))])
        await until(lambda: ("big", 0, True) in sink.landed)
        proven = listener.conns["p"]
        await until(lambda: proven in listener.idle)  # between frames: idle longest from here
        for _ in range(5):  # each past the third shuts another that never said who it is
            known = set(listener.idle)
            silent.append(socket.create_connection((host, port)))
            await until(lambda k=known: set(listener.idle) - k)  # accepted
        await stream.send("big", 1, [memoryview(payload(1))])
        await until(lambda: ("big", 1, True) in sink.landed)
        assert listener.conns["p"] is proven  # never shut: no reconnect
        silent[-1].settimeout(5)  # and one in its handshake is shut at its deadline
        assert await asyncio.to_thread(silent[-1].recv, 1) == b""
    finally:
        stream.close()
        for s in silent:
            s.close()
        await listener.close()


async def test_the_writer_skips_ended_frames_survives_a_bad_one_and_ends_when_idle(
    monkeypatch,
) -> None:
    """The prefill side's writer thread: a frame whose transfer ended while queued is not
    sent (its views may be another transfer's by then); a frame it cannot write (not a
    contiguous buffer) is logged and the next one still goes; idle for IDLE_S, it closes
    its stream (the reader takes that as a clean end) and the next frame starts another."""
    monkeypatch.setattr(tcp_send, "IDLE_S", 0.3)
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    stream = TcpStream(listener.address, "p")
    try:
        await stream.send("big", 0, [memoryview(payload(0))], skip=lambda: True)
        strided = memoryview(np.zeros(2 * FRAME, dtype=np.uint8))[::2]  # FRAME bytes, apart
        await stream.send("big", 1, [strided])
        await stream.send("big", 2, [memoryview(payload(2))])
        await asyncio.wait_for(stream.flush(), 30)
        await until(lambda: len(sink.landed) == 1)
        assert sink.landed == [("big", 2, True)] and stream.failed == 0
        first = stream.writer
        await until(lambda: stream.writer is None and not listener.conns, 10.0, "idle end")
        await stream.send("big", 3, [memoryview(payload(3))])
        await until(lambda: len(sink.landed) == 2)
        assert sink.landed[-1] == ("big", 3, True) and stream.writer is not first
    finally:
        stream.close()
        await listener.close()
    assert all(ok for _, _, ok in sink.landed)


async def test_a_writer_that_dies_strands_no_frame_and_the_next_one_starts_afresh() -> None:
    """Whatever ends a writer thread, what it left queued gives its slots back and its
    flushes return (the peer's sender task waits on those slots: stranded, every later
    message to that decode node would wait for good), and the next frame starts a writer."""
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    stream = TcpStream(listener.address, "p")
    written = stream._write_frame
    go = threading.Event()

    def broken(frame: object) -> None:
        go.wait(10)  # until the others are queued behind it
        raise OSError("the wire broke")

    def worse(exc: OSError) -> None:
        raise RuntimeError("and its handler too")  # ends the writer thread

    try:
        stream._write_frame = broken  # type: ignore[method-assign]
        stream._failed = worse  # type: ignore[method-assign]
        for layer in range(tcp_send.DEPTH):  # the first being written, the next queued
            await asyncio.wait_for(stream.send("big", layer, [memoryview(b"x")]), 10)
        flushed = asyncio.ensure_future(stream.flush())  # queued behind them
        await until(lambda: stream.queue.qsize() == tcp_send.DEPTH, 10.0, "both queued")
        go.set()
        await asyncio.wait_for(flushed, 10)  # given back by the dying writer
        await until(lambda: stream.writer is None, 10.0, "the writer ended")
        for _ in range(tcp_send.DEPTH):  # the slots came back: no wait
            await asyncio.wait_for(stream.send("big", 9, [memoryview(b"x")]), 1)
        # those started a writer that breaks too: once it has ended, a real one (a writer
        # still running when the real write came back would send them: a loaded host)
        await until(lambda: stream.writer is None, 10.0, "the second writer ended")
        stream._write_frame = written  # type: ignore[method-assign]
        await asyncio.wait_for(stream.send("big", 0, [memoryview(payload(0))]), 10)
        await until(lambda: sink.landed == [("big", 0, True)], 10.0, "a fresh writer's frame")
    finally:
        go.set()
        stream.close()
        await listener.close()


async def test_a_decode_node_on_a_new_port_gets_a_stream_beside_the_old_one() -> None:
    """Transfers begun before a decode node moved to another port still name the old one:
    with one stream per node, alternating frames switched it back and forth, and each
    reconnect made the listener shut the stream before it (its frames cut). Now each
    endpoint keeps its stream, two per node, the least recently used retired."""
    sinks = [Sink() for _ in range(3)]
    listeners = [TcpListener("127.0.0.1", timeout=10.0) for _ in sinks]
    for listener, sink in zip(listeners, sinks, strict=True):
        listener.start(sink)
    local = SimpleNamespace(node_id="p", key=None, timeout=10.0)
    send = tcp.TcpSend(local)  # type: ignore[arg-type]

    def transfer(listener: TcpListener) -> Any:
        target = SimpleNamespace(node_id="d", kv_endpoints={"tcp": listener.address})
        return SimpleNamespace(target=target, request_id="big", ended=None)

    try:
        for layer in range(4):  # old, new, old, new
            await send.send(transfer(listeners[layer % 2]), layer, [memoryview(payload(layer))])
        await until(lambda: len(sinks[0].landed) == 2 and len(sinks[1].landed) == 2)
        first = [listeners[i].conns["p"] for i in range(2)]
        await send.send(transfer(listeners[0]), 4, [memoryview(payload(4))])
        await until(lambda: len(sinks[0].landed) == 3)
        assert [listeners[i].conns["p"] for i in range(2)] == first  # no reconnect
        await send.send(transfer(listeners[2]), 5, [memoryview(payload(5))])  # a third port
        await until(lambda: len(sinks[2].landed) == 1)
        assert {k[1] for k in send.streams} == {listeners[0].address, listeners[2].address}
    finally:
        await send.close()
        for listener in listeners:
            await listener.close()
