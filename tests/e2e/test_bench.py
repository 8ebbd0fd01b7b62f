"""`pdserve bench` against a real (simulated-engine) cluster: a few seconds of traffic."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_smoke_through_a_real_cluster(make_cluster, tmp_path):
    cluster = make_cluster(engine="sim", prefill=2, decode=2, node_flags=("--sim-time-scale", "1"))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "common.cli",
        "bench",
        "--url",
        cluster.url,
        "--num-requests",
        "30",
        "--rate",
        "10",
        "--burstiness",
        "0.5",
        "--input-len",
        "uniform:300:200",
        "--output-len",
        "fixed:12",
        "--warmup",
        "2",
        "--slo",
        "ttft=2000,tpot=200",
        "--seed",
        "3",
        "--out",
        str(out),
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 30 and summary["failed"] == 0
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p99"] <= summary["ttft_ms_max"]
    assert summary["tpot_ms_p50"] > 0 and summary["goodput"] > 0
    assert summary["output_throughput"] > 0 and summary["duration_s"] > 2
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 30
    assert all(json.loads(line)["output_tokens"] == 12 for line in lines)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["completed"] == 30 and "bench" in saved["command"]
    assert "| ttft_ms_p50 |" in (out / "summary.md").read_text()
