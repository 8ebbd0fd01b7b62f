"""A whole cluster on IPv6 alone: `pdserve up --host ::1` (gateway HTTP, control and tokens
sockets on ::1; the nodes reach it there, advertise ::1 and listen there, KV between them
over tcp) serves its streams with the exact sim text. No socket spoke IPv6: the gateway's
ZeroMQ binds at tcp://[::1] failed, so the cluster never came up."""

from __future__ import annotations

import signal
import socket

import pytest

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import Cluster, start_up, wait_up
from tests.e2e.streams import run_streams, sim_text


def _bodies(n: int) -> list[dict]:
    return [
        {"prompt": list(range(2000 + 11 * i, 2030 + 11 * i + i % 7)), "max_tokens": 40,
         "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True}
        for i in range(n)
    ]  # fmt: skip


def test_a_cluster_on_ipv6_loopback_alone_serves_its_streams(tokenizer):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    port, control, tokens = free_port(), free_port(), free_port()
    args = ["--engine", "sim", "--host", "::1", "--prefill", "1", "--decode", "2"]
    args += ["--kv-backend", "tcp", "--port", str(port), "--control-port", str(control)]
    args += ["--tokens-port", str(tokens), "--startup-timeout", "180", "--sim-time-scale", "0.05"]
    proc = start_up(args)
    lines: list[str] = []
    try:
        line = wait_up(proc, lines)
        assert f"http://[::1]:{port}" in line, lines[-20:]
        url = f"http://[::1]:{port}"
        bodies = _bodies(36)
        results = run_streams(url, bodies, 60)
        failed = [(i, r) for i, r in enumerate(results) if not r.ok]
        assert not failed, failed[:3]
        for body, r in zip(bodies, results, strict=True):
            assert r.text == sim_text(tokenizer, body["prompt"], body["seed"], body["max_tokens"])
        gateway = Cluster(url=url, control="")
        # every stream's KV went between the nodes over tcp, at their ::1 addresses
        assert gateway.metric("pdserve:kv_transfer_bytes_total", backend="tcp") > 0
        assert gateway.metric("pdserve:kv_transfer_bytes_total", backend="shm") == 0
        # and nothing of it listens on IPv4: ::1 alone, as told
        for taken in (port, control, tokens):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", taken), timeout=5).close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
