"""Chaos under steady streaming load on a 2P2D sim cluster: a prefill node and a decode node
SIGKILLed and restarted, the other decode node drained (SIGTERM: its sequences migrate with
their KV), and a prefill node frozen by SIGSTOP for 5 s then resumed. Figures checked
and printed: hung requests (none may pass the client's bound), completed share (>= 99 %),
detection time of each fault (<= 2 s), every completed text exact, no KV block left in use
on any node, the gateway's request table empty, and the gateway's RSS within 10 % of its
level after a warm-up run of the same load. --chaos-long runs 10x the requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from tests.e2e.conftest import Cluster, wait_for
from tests.e2e.streams import run_streams
from tests.e2e.test_stress import sim_text

# ~1 s of decode per request: at 20 requests/s each node holds work when it is hit
NODE_FLAGS = ("--sim-time-scale", "0.5", "--kv-backend", "tcp")
BOUND_S = 60.0
DECODES = ("decode-0", "decode-1")  # a request not ended this long after it was sent counts as hung


def _bodies(n: int, offset: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": list(range(1000 + 7 * i, 1000 + 7 * i + 40 + i % 50)),
            "max_tokens": 160,  # long enough that the drained node holds running sequences
            "temperature": 1.0,
            "seed": offset + i,
            "ignore_eos": True,
            "stream": True,
        }
        for i in range(n)
    ]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _nodes(cluster: Cluster) -> set[str]:
    import json

    status, text = cluster.get("/health")
    return set(json.loads(text)["nodes"]) if status in (200, 503) else set()


def _restart(cluster: Cluster, role: str, node_id: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", role]
    cmd += ["--gateway", cluster.control, "--node-id", node_id, *cluster.node_flags]
    proc = subprocess.Popen(cmd)
    cluster.procs.append(proc)
    return proc


class Detector:
    """Polls /health every 20 ms: when each node id left the gateway's registry."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.gone_at: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        known: set[str] = set()
        while not self.stop.is_set():
            now = _nodes(self.cluster)
            for node in known - now:
                self.gone_at.setdefault(node, time.monotonic())
            known = now
            time.sleep(0.02)


def test_kill_restart_and_freeze_nodes_under_streaming_load(
    make_cluster, tokenizer, chaos_scale: int
):
    cluster = make_cluster(
        prefill=2,
        decode=2,
        engine="sim",
        gateway_flags=("--heartbeat-timeout", "1.0"),
        node_flags=NODE_FLAGS,
    )
    gateway = cluster.procs[0]
    procs = dict(
        zip(["prefill-0", "prefill-1", "decode-0", "decode-1"], cluster.procs[1:], strict=True)
    )
    n = 300 * chaos_scale
    spacing = 15.0 / 300  # 20 requests/s: 15 s of load in the short form
    warm = _bodies(n, 0)
    assert all(r.ok for r in run_streams(cluster.url, warm, BOUND_S, spacing))
    rss_warm = _rss_kib(gateway.pid)

    bodies = _bodies(n, 10**6)
    results: list = []
    load = threading.Thread(
        target=lambda: results.extend(run_streams(cluster.url, bodies, BOUND_S, spacing))
    )
    detector = Detector(cluster)
    load.start()
    faults: dict[str, float] = {}
    time.sleep(2.0)
    procs["prefill-0"].kill()
    faults["prefill-0"] = time.monotonic()
    time.sleep(1.0)
    # the decode node running more sequences dies (they are re-placed); the other drains later
    running = {d: cluster.metric("pdserve:num_requests_running", node=d) for d in DECODES}
    dead = max(DECODES, key=lambda d: running[d])
    drained = next(d for d in DECODES if d != dead)
    procs[dead].kill()
    faults[dead] = time.monotonic()
    assert wait_for(lambda: {"prefill-0", dead} <= set(detector.gone_at), timeout=5)
    restarted = [_restart(cluster, "prefill", "prefill-0"), _restart(cluster, "decode", dead)]
    assert wait_for(lambda: {"prefill-0", dead} <= _nodes(cluster), timeout=30)
    time.sleep(0.5)
    procs[drained].send_signal(signal.SIGTERM)  # drains: live migration to the restarted one
    time.sleep(1.0)
    frozen = procs["prefill-1"].pid
    os.kill(frozen, signal.SIGSTOP)
    faults["prefill-1"] = time.monotonic()
    time.sleep(5.0)
    os.kill(frozen, signal.SIGCONT)
    load.join(BOUND_S * 2 + n * spacing)
    detector.stop.set()
    assert not load.is_alive(), "the load generator itself hung"

    hung = [r for r in results if "TimeoutError" in r.error]
    completed = [(b, r) for b, r in zip(bodies, results, strict=True) if r.ok]
    wrong = [
        (r.text, b["seed"])
        for b, r in completed
        if r.text != sim_text(tokenizer, b["prompt"], b["seed"], b["max_tokens"])
    ]
    detection = {node: detector.gone_at[node] - t for node, t in faults.items()}
    back = {"prefill-0", "prefill-1", dead}  # the frozen one is back; the other drained
    assert wait_for(lambda: _nodes(cluster) >= back, timeout=30)
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, timeout=15)
    assert wait_for(lambda: cluster.metric("pdserve:gateway_attempts_in_flight") == 0, timeout=5)
    rss = _rss_kib(gateway.pid)
    figures = {
        "requests": n,
        "completed_share": round(len(completed) / n, 4),
        "failed_cleanly": n - len(completed) - len(hung),
        "hung": len(hung),
        "wrong_text": len(wrong),
        "detection_s": {k: round(v, 2) for k, v in detection.items()},
        "replacements": cluster.metric("pdserve:request_replacements_total"),
        "migrated": cluster.metric("pdserve:kv_migrations_total", result="moved"),
        "kv_blocks_in_use_after": cluster.metric("pdserve:kv_blocks", state="in_use"),
        "gateway_rss_vs_warm": round(rss / rss_warm, 3),
        "p99_request_s": round(sorted(r.seconds for r in results)[int(0.99 * (n - 1))], 2),
    }
    print(f"\nchaos figures: {figures}")
    assert not hung, [r.error for r in hung[:3]]
    assert not wrong, wrong[:3]
    assert len(completed) >= 0.99 * n, [r.error for r in results if not r.ok][:5]
    assert all(v <= 2.0 for v in detection.values()), detection
    assert rss <= 1.10 * rss_warm, (rss, rss_warm)
    survivors = [gateway, procs["prefill-1"], *restarted]
    assert all(p.poll() is None for p in survivors), "a process died"
    assert procs[drained].wait(30) == 0  # the drained node exited cleanly
    # the drain bit (the killed node usually held sequences too: "replacements", reported;
    # whether it did at that instant is the load's timing, so it is not asserted)
    assert figures["migrated"] > 0, figures
