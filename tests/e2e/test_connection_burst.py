"""A burst of connections larger than aiohttp's default listen backlog (128) while the
gateway cannot run (a GC pause, a starved CPU): the kernel completes every handshake into
the gateway's accept queue (backlog 2048), so no client waits on a dropped SYN's 1 s
retransmit, and the gateway answers each of them when it runs again. Real process."""

from __future__ import annotations

import os
import select
import signal
import socket
import time

from tests.e2e.conftest import wait_for

BURST = 500  # past 128, under the gateway's 2048


def _connecting(port: int) -> list[socket.socket]:
    socks = []
    for _ in range(BURST):
        sock = socket.socket()
        sock.setblocking(False)
        assert sock.connect_ex(("127.0.0.1", port)) in (0, 115)  # EINPROGRESS
        socks.append(sock)
    return socks


def _connected(socks: list[socket.socket]) -> int:
    """How many handshakes completed: writable with no error (a dropped SYN stays pending)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLOUT)
    ready = {fd for fd, ev in poller.poll(0) if ev & select.POLLOUT and not ev & select.POLLERR}
    return sum(sock.fileno() in ready for sock in socks)


def test_a_burst_of_connections_while_the_gateway_is_frozen_is_queued_and_answered(
    make_cluster,
):
    cluster = make_cluster(engine="sim", node_flags=("--sim-time-scale", "0.05"))
    port = int(cluster.url.rsplit(":", 1)[1])
    gateway = cluster.procs[0]
    os.kill(gateway.pid, signal.SIGSTOP)
    try:
        socks = _connecting(port)
        # every handshake done by the kernel alone, up to its own cap (net.core.somaxconn:
        # 4096 on Linux 5.4 and later); with aiohttp's 128, 129 and the rest pending for as
        # long as the gateway is frozen (each SYN dropped again at its retransmit)
        with open("/proc/sys/net/core/somaxconn") as f:
            room = min(BURST, min(2048, int(f.read())) + 1)
        assert wait_for(lambda: _connected(socks) >= room, timeout=5, interval=0.05), (
            _connected(socks), room
        )
    finally:
        os.kill(gateway.pid, signal.SIGCONT)
    for sock in socks:
        sock.setblocking(True)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    started = time.monotonic()
    answered = 0
    for sock in socks:
        sock.settimeout(30)
        head = sock.recv(64)
        answered += head.startswith(b"HTTP/1.1 200")
        sock.close()
    assert answered == BURST, answered
    print(f"\nconnection burst: {BURST} queued while frozen, answered in "
          f"{time.monotonic() - started:.2f} s")  # fmt: skip
