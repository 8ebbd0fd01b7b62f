"""A decode node SIGKILLed while it runs streams and restarted at once under its own id (as
a supervisor, compose or Kubernetes restarts a crashed process), with the gateway's lease
long (30 s) so that only the new process's registration can explain a fast recovery: the
new process replaces the old one as soon as the old one has been silent for twice its
heartbeats' gap (gateway/succession.py), the old one's requests are placed again then, not
at the lease's end, and every stream completes with its exact text. Before, the new process
was refused ("already registered") and exited; its requests waited out the lease."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from pdserve.common.wire.transport import free_port
from tests.chaos.test_node_faults import _running
from tests.e2e.conftest import wait_for
from tests.e2e.streams import StreamResult, run_streams, sim_text

LEASE_S = 30.0
# the new process's start (Python, imports, the sim engine) and its registration: ~1-2 s
# on an idle 2-vCPU host, several times that beside the streams and the other processes
TAKEOVER_S = LEASE_S / 2


def _body(i: int) -> dict[str, Any]:
    return {"prompt": list(range(2000 + 5 * i, 2040 + 5 * i + i % 30)), "max_tokens": 120,
            "temperature": 1.0, "seed": 500 + i, "ignore_eos": True, "stream": True}  # fmt: skip


def test_a_node_restarted_under_its_id_takes_over_before_its_lease_ends(make_cluster, tokenizer):
    port = free_port()
    cluster = make_cluster(
        engine="sim",
        gateway_flags=("--heartbeat-timeout", str(LEASE_S)),
        node_flags=("--sim-time-scale", "0.5", "--kv-backend", "tcp"),
        extra={"decode-0": ("--metrics-port", str(port))},
    )
    decode = cluster.procs[2]  # the gateway, prefill-0, decode-0
    bodies = [_body(i) for i in range(60)]
    results: list[StreamResult] = []

    def send() -> None:
        results.extend(run_streams(cluster.url, bodies, 90, 0.05))

    load = threading.Thread(target=send)
    load.start()
    assert wait_for(lambda: _running(port) >= 2, 60, 0.01), "decode-0 never ran 2 sequences"
    decode.kill()
    killed = time.monotonic()
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "decode", "--gateway",
           cluster.control, "--node-id", "decode-0", *cluster.node_flags,
           "--metrics-port", str(port)]  # fmt: skip
    restarted = subprocess.Popen(cmd)
    cluster.procs.append(restarted)
    lost = "pdserve:request_replacements_total"
    assert wait_for(lambda: cluster.metric(lost, kind="lost") > 0, LEASE_S, 0.02)
    replaced_after = time.monotonic() - killed
    load.join(120)
    print(f"\nthe killed node's requests placed again {replaced_after:.2f} s after the kill")
    assert replaced_after < TAKEOVER_S, replaced_after
    assert restarted.poll() is None, "the restarted node was refused"
    assert len(results) == len(bodies) and all(r.ok for r in results), [
        r.error for r in results if not r.ok
    ]
    wrong = [b["seed"] for b, r in zip(bodies, results, strict=True)
             if r.text != sim_text(tokenizer, b["prompt"], b["seed"], b["max_tokens"])]  # fmt: skip
    assert wrong == []
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, 15)
    assert cluster.metric("pdserve:gateway_attempts_in_flight") == 0
