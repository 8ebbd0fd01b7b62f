"""IPv6 on real sockets: the ZeroMQ sockets (make_socket) and the tcp KV listener and stream
bind and connect at ::1, and a listener on every interface takes IPv4 and IPv6 peers. Every
socket was IPv4's alone: tcp://[::1]:P could be neither bound nor connected, and `0.0.0.0`
kept IPv6 peers out."""

from __future__ import annotations

import asyncio
import socket

import zmq
import zmq.asyncio

from pdserve.common.kv.tcp import TcpListener, TcpStream
from pdserve.common.wire.address import EVERYWHERE, listening_socket, split_host_port
from pdserve.common.wire.transport import bound_address, make_socket
from tests.component.cluster import until
from tests.component.test_tcp_stream import FRAME, Sink, payload


async def test_zmq_sockets_bind_and_connect_over_ipv6_and_everywhere_takes_both():
    ctx = zmq.asyncio.Context()
    try:
        for bind, peer in (
            ("tcp://[::1]:0", "::1"),
            ("tcp://*:0", "::1"),  # every interface: IPv6 peers ...
            ("tcp://*:0", "127.0.0.1"),  # ... and IPv4 ones
            ("tcp://127.0.0.1:0", "127.0.0.1"),
            ("tcp://127.0.0.1:0", "localhost"),
        ):
            router = make_socket(ctx, "node.data", bind)
            address = bound_address(router, peer)
            dealer = make_socket(ctx, "node.data_out", address, identity="d")
            try:
                await dealer.send(b"hello")
                got = await asyncio.wait_for(router.recv_multipart(), 10)
                assert got == [b"d", b"hello"], (bind, peer)
            finally:
                dealer.close(0)
                router.close(0)
        # an IPv4 address binds as before: an IPv4 socket, not an IPv6 one mapped
        router = make_socket(ctx, "node.data", "tcp://127.0.0.1:0")
        assert router.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:")
        router.close(0)
    finally:
        ctx.destroy(0)


def test_a_listener_everywhere_takes_ipv4_and_ipv6():
    with listening_socket(EVERYWHERE, 0) as sock:
        sock.listen(4)
        port = sock.getsockname()[1]
        for host in ("127.0.0.1", "::1"):
            with socket.create_connection((host, port), timeout=5):
                conn, _ = sock.accept()
                conn.close()
    with listening_socket("::1", 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


async def test_kv_frames_travel_over_ipv6():
    """A decode node advertised at ::1: its tcp KV address is [::1]:P, and a prefill node's
    stream reaches it (the listener was AF_INET, the stream split the host at its colons)."""
    for listen in ("::1", EVERYWHERE):
        sink = Sink()
        listener = TcpListener("::1", timeout=10.0, listen=listen)
        listener.start(sink)
        assert listener.address.startswith("[::1]:")
        assert split_host_port(listener.address)[0] == "::1"
        stream = TcpStream(listener.address, "p")
        try:
            await stream.send("big", 0, [memoryview(payload(0))])
            await until(lambda: ("big", 0, True) in sink.landed)  # noqa: B023
            landed = b"".join(bytes(v) for v in sink.views(0)[::-1])
            assert len(landed) == FRAME and landed == payload(0).tobytes()
        finally:
            stream.close()
            await listener.close()
