"""A cluster started with --cluster-key serves exact text over authenticated sockets (CurveZMQ
control, tokens and data sockets, the challenged tcp KV stream), and a node process without
the key, or with another one, never registers: it gets no prompt and no KV."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import wait_for
from tests.e2e.streams import sim_text


def _keygen(path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "keygen", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "public key" in done.stdout


def _unregistered(port: int) -> bool:
    """The node on this metrics port is up and says it is not registered."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return False  # 200: registered
    except urllib.error.HTTPError as err:
        return "not registered" in err.read().decode()
    except OSError:
        return False  # not up yet


def test_a_keyed_cluster_serves_and_refuses_nodes_without_the_key(
    make_cluster, tokenizer, tmp_path
):
    key, other = tmp_path / "cluster.key", tmp_path / "other.key"
    _keygen(key)
    _keygen(other)
    flags = ("--cluster-key", str(key))
    cluster = make_cluster(
        prefill=1,
        decode=1,
        engine="sim",
        gateway_flags=flags,
        node_flags=(*flags, "--sim-time-scale", "0.02", "--kv-backend", "tcp"),
    )
    rogues, ports = [], [free_port(), free_port()]
    kinds = (("rogue-nokey", ()), ("rogue-otherkey", ("--cluster-key", str(other))))
    for (name, extra), port in zip(kinds, ports, strict=True):
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "decode"]
        cmd += ["--gateway", cluster.control, "--node-id", name, "--engine", "sim"]
        cmd += ["--heartbeat-interval", "0.2", "--metrics-port", str(port), *extra]
        rogues.append(subprocess.Popen(cmd))

    def refused() -> float:  # a peer without the key (or with another) fails its handshake
        return cluster.metric("pdserve:refused_peers_total", kind="handshake")

    try:
        # both up and trying (not from their launch: a slow start would leave the window
        # empty), then refused many times over while the gateway knows only its members
        assert wait_for(lambda: all(_unregistered(p) for p in ports), 60), "rogues never up"
        seen = refused()

        def only_members() -> bool:
            _, text = cluster.get("/health")
            assert set(json.loads(text)["nodes"]) == {"prefill-0", "decode-0"}
            return refused() >= seen + 20

        assert wait_for(only_members, 60, interval=0.2)
        assert all(_unregistered(p) for p in ports)
        for i in range(12):  # nothing goes to the rogues: every text exact, from decode-0
            prompt = list(range(2000 + 10 * i, 2030 + 10 * i))
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": i}
            status, got = cluster.post("/v1/completions", {**body, "ignore_eos": True})
            assert status == 200, got
            assert got["choices"][0]["text"] == sim_text(tokenizer, prompt, i, 6)
        assert cluster.metric("pdserve:kv_transfer_bytes_total", backend="tcp") > 0
        assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0)
    finally:
        for proc in rogues:
            proc.kill()
            proc.wait(10)
