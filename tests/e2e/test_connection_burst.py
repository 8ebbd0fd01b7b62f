"""A burst of connections larger than aiohttp's default listen backlog (128) while the
gateway cannot run (a GC pause, a starved CPU): the kernel completes every handshake into
the gateway's accept queue (backlog 2048), so no client waits on a dropped SYN's 1 s
retransmit, and the gateway answers each of them when it runs again. Real process."""

from __future__ import annotations

import errno
import itertools
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import wait_for

BURST = 500  # past 128, under the gateway's 2048

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux's accept queue")


def _somaxconn() -> int:
    return int(Path("/proc/sys/net/core/somaxconn").read_text())


def _listen_overflows() -> int:
    """TcpExt ListenOverflows of this network namespace: SYNs dropped at a full queue."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    names, values = next(
        (a.split(), b.split()) for a, b in itertools.pairwise(lines) if a.startswith("TcpExt:")
    )
    return int(values[names.index("ListenOverflows")])


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
    if _somaxconn() < BURST:  # the kernel caps any backlog there: nothing to tell apart
        pytest.skip(f"net.core.somaxconn is {_somaxconn()}, under {BURST}")
    cluster = make_cluster(engine="sim", node_flags=("--sim-time-scale", "0.05"))
    port = int(cluster.url.rsplit(":", 1)[1])
    gateway = cluster.procs[0]
    socks: list[socket.socket] = []
    overflows = _listen_overflows()
    os.kill(gateway.pid, signal.SIGSTOP)
    try:
        for _ in range(BURST):
            socks.append(socket.socket())
            socks[-1].setblocking(False)
            assert socks[-1].connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
        # every handshake done by the kernel alone; with aiohttp's 128, 129 and the rest
        # pending for as long as the gateway is frozen (each SYN dropped again)
        connected = wait_for(lambda: _connected(socks) == BURST, timeout=5, interval=0.05)
        assert connected, _connected(socks)
        assert _listen_overflows() == overflows  # and none was dropped on the way
    finally:
        os.kill(gateway.pid, signal.SIGCONT)
    started = time.monotonic()
    answered = 0
    try:
        for sock in socks:
            sock.settimeout(30)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for sock in socks:
            answered += sock.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()
    assert answered == BURST, answered
    print(f"\nconnection burst: {BURST} queued while frozen, answered in "
          f"{time.monotonic() - started:.2f} s")  # fmt: skip
