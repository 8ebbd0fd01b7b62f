"""`pdserve bench` against a real (simulated-engine) cluster: a few seconds of traffic."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import Cluster, start_cluster


def test_bench_smoke_through_a_real_cluster(make_cluster, tmp_path):
    # 1P1D: the tool's run and its reports are the point, not the cluster's size
    cluster = make_cluster(engine="sim", node_flags=("--sim-time-scale", "1"))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
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
    # the server's TTFT (its `timings`) is inside the client's: arrival -> first token out
    records = [json.loads(line) for line in lines]
    assert all(0 < r["server_ttft_ms"] <= r["ttft_ms"] for r in records)
    assert 0 < summary["server_ttft_ms_p50"] <= summary["ttft_ms_p50"]

    # the chat endpoint: the same prompts as text, through the gateway's template and tokenizer
    chat = [*cmd[: cmd.index("--out")], "--endpoint", "chat", "--input-len", "200"]
    chat[chat.index("--num-requests") + 1] = "10"
    done = subprocess.run(chat, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 10 and summary["failed"] == 0
    assert summary["server_ttft_ms_p50"] is not None


@pytest.fixture(scope="module")
def baseline():
    """One gateway per baseline scheduler over the same nodes (both keep the prefill nodes'
    local queues, which the nodes take from the gateway they register with), each test at
    its own gateway, counting its own placements."""
    cluster = start_cluster(
        engine="sim",
        prefill=2,
        decode=2,
        gateways=2,
        each_gateway=[("--scheduler", "round_robin"), ("--scheduler", "jsq")],
        node_flags=("--sim-time-scale", "1", "--max-batch", "2"),
    )
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("scheduler", ["round_robin", "jsq"])
def test_baseline_schedulers_queue_on_prefill_nodes_and_complete(baseline, scheduler):
    url = baseline.urls[["round_robin", "jsq"].index(scheduler)]
    body = {"prompt": list(range(100, 1100)), "max_tokens": 4, "ignore_eos": True}
    cluster = Cluster(url=url, control=baseline.control)
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: cluster.post("/v1/completions", body), range(12)))
    assert [status for status, _ in results] == [200] * 12
    accepts = [
        cluster.metric("pdserve:placement_accepts_total", node=f"prefill-{i}") for i in range(2)
    ]
    assert sum(accepts) == 12  # the chosen node always accepts: it queues
    assert cluster.metric("pdserve:placement_rejects_total") == 0
    if scheduler == "round_robin":
        assert accepts == [6, 6]
