"""The tcp KV stream reads a frame straight into its targets in a bounded number of system
calls, however scattered the targets: the check that fails if a per-chunk read, a per-block
read or an intermediate copy comes back (issue 30). Real sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence

import numpy as np
import pytest

from pdserve.common.kv import tcp
from pdserve.common.kv.tcp import TcpListener, TcpStream
from tests.component.cluster import until  # waits on the listener's own state, not on time

FRAMES = 8
FRAME = 4 << 20  # 32 MiB in all: many socket buffers' worth
RUN = 16 << 10  # scattered targets: one view per 16 KiB, as a fragmented block table gives


class Sink:
    """Targets for every frame: `RUN`-sized views of one arena, in reverse order."""

    def __init__(self) -> None:
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


def payload(layer: int) -> np.ndarray:
    return (np.arange(FRAME, dtype=np.uint32) * 2654435761 + layer).astype(np.uint8)


async def test_scattered_frames_land_in_few_receives() -> None:
    sink = Sink()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
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
        tcp._shut(conn)  # what a full listener does to an idle stream
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
        with contextlib.suppress(OSError):  # ETIMEDOUT; wait_for's TimeoutError fails below
            await asyncio.wait_for(stream.send("big", 0, [big]), 20)
            raise AssertionError("the send completed into a peer that reads nothing")
        # 3 x the timeout without progress (TCP_USER_TIMEOUT), plus zero-window probing
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
