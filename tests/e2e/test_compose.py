"""The Docker Compose stack for real: build the image on CPU, `up --wait` with 2 prefill and
2 decode replicas and the embedded model, stream a chat request through the published port,
run a short `pdserve bench` against it, read /metrics from the gateway and from a node,
then `down`. It needs a Docker engine: `.ci/run` starts one when CI=true (where this test
must not skip); elsewhere it skips with the reason.

Offline by design: the wheels are downloaded on the host (docker/wheels.sh) and the base
image is PDSERVE_TEST_BASE_IMAGE (CI builds `local/pdserve-python` with debootstrap).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.common.transport import free_port
from tests.docker_util import compose_or_skip

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Name three colours of the rainbow."


def _wait_nodes(url: str, want: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                body = json.loads(resp.read())
                if len(body["nodes"]) >= want:
                    return body
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{want} nodes did not register within {timeout:.0f} s: {body}")


def _stream_chat(url: str) -> tuple[str, str, list[dict]]:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-request-id": "compose-test-1"},
    )
    chunks: list[dict] = []
    with urllib.request.urlopen(request, timeout=120) as resp:
        echoed = resp.headers["x-request-id"]
        lines = [line.decode().strip() for line in resp]
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, echoed, chunks


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    compose = compose_or_skip()
    subprocess.run(
        ["bash", str(ROOT / "docker/wheels.sh")],
        check=True,
        cwd=ROOT,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    port = free_port()
    models = tmp_path_factory.mktemp("models")  # empty: the embedded model is used
    env = {
        **os.environ,
        "PDSERVE_IMAGE": "pdserve:test",
        "PDSERVE_BASE_IMAGE": os.environ.get(
            "PDSERVE_TEST_BASE_IMAGE", "python:3.11-slim-bookworm"
        ),
        "PDSERVE_BIND": "127.0.0.1",
        "PDSERVE_PORT": str(port),
        "PDSERVE_MODEL_DIR": str(models),
        "PDSERVE_KV_CACHE_GB": "0.25",
        "PDSERVE_SHM_SIZE": "512mb",
    }
    project = f"pdserve-test-{secrets.token_hex(3)}"
    base = [*compose, "-p", project, "-f", "compose.yaml", "-f", "compose.cpu.yaml"]

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*base, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        out = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0, f"{' '.join(args)}:\n{out}"
        return done

    started = time.monotonic()
    run("build", "gateway")
    built = time.monotonic()
    try:
        run(
            "up",
            "-d",
            "--wait",
            "--wait-timeout",
            "600",
            "--scale",
            "prefill=2",
            "--scale",
            "decode=2",
            timeout=700,
        )
        url = f"http://127.0.0.1:{port}"
        health = _wait_nodes(url, 4, timeout=120)
        print(f"compose: build {built - started:.0f} s, up {time.monotonic() - built:.0f} s")
        yield url, run, health
    finally:
        logs = subprocess.run(
            [*base, "logs", "--no-color"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        Path(ROOT / "build").mkdir(exist_ok=True)
        (ROOT / "build/compose-test.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(
            [*base, "down", "-v", "--remove-orphans", "--timeout", "20"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=300,
        )


def test_compose_stack_serves_streams_benches_and_reports(stack, smol_runner, tokenizer):
    from tests.conftest import chat_ids, make_engine

    url, run, health = stack
    roles = sorted(health["nodes"].values())
    assert roles == ["decode", "decode", "prefill", "prefill"]
    # default node ids are the compose container names, read from Docker's DNS
    for node_id, role in health["nodes"].items():
        assert re.fullmatch(rf"pdserve-test-[0-9a-f]+-{role}-[12]", node_id), node_id

    text, echoed, chunks = _stream_chat(url)
    assert echoed == "compose-test-1"  # the client's id comes back
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        chunks[-1]["usage"]["completion_tokens"] == 24
        or chunks[-2]["choices"][0]["finish_reason"] == "stop"
    )
    # the correctness invariant across containers: float32 greedy equals one process
    from pdserve.common.sampling import SamplingParams

    engine = make_engine(smol_runner, tokenizer)
    [out] = engine.generate(
        [chat_ids(tokenizer, PROMPT)], SamplingParams(max_tokens=24, temperature=0.0)
    )
    assert text == out.text

    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "bench",
            "--url",
            url,
            "--num-requests",
            "12",
            "--rate",
            "4",
            "--input-len",
            "uniform:200:100",
            "--output-len",
            "fixed:8",
            "--seed",
            "5",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    summary = json.loads(bench.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 12 and summary["failed"] == 0

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert _metric(metrics, "pdserve:time_to_first_token_seconds_count") >= 13
    assert _metric(metrics, "pdserve:requests_total", outcome="ok") >= 13
    assert _metric(metrics, "pdserve:request_prefill_time_seconds_count") >= 13
    nodes = {
        line.split('node="')[1].split('"')[0]
        for line in metrics.splitlines()
        if line.startswith("pdserve:kv_blocks{")
    }
    assert len(nodes) == 4
    # both prefill replicas took work (on-demand forwarding spreads a burst)
    accepts = [
        _metric(metrics, "pdserve:placement_accepts_total", node=n)
        for n in health["nodes"]
        if health["nodes"][n] == "prefill"
    ]
    assert all(a > 0 for a in accepts), accepts
    # containers share the gateway's IPC namespace: KV went through shared memory
    assert _metric(metrics, "pdserve:kv_transfer_bytes_total", backend="shm") > 0
    assert _metric(metrics, "pdserve:kv_transfer_bytes_total", backend="zmq") == 0

    # every process serves its own metrics: read one node's from inside the network
    probe = (
        "import urllib.request as u; "
        "print(u.urlopen('http://127.0.0.1:9100/metrics', timeout=5).read().decode())"
    )
    node_metrics = run("exec", "-T", "prefill", "python3", "-c", probe, timeout=60).stdout
    assert _metric(node_metrics, "pdserve:offers_total", decision="accept") > 0
    assert "pdserve:kv_cache_usage_perc{" in node_metrics

    # the per-request timeline is a JSON line under the client's request id
    logs = run("logs", "--no-color", "gateway", timeout=60).stdout
    records = [
        json.loads(line.split("| ", 1)[1])
        for line in logs.splitlines()
        if '"event":"request"' in line and "| " in line
    ]
    [mine] = [r for r in records if r["x_request_id"] == "compose-test-1"]
    assert mine["outcome"] in ("stop", "length") and mine["output_tokens"] > 1
    assert {"gateway_wait_ms", "prefill_ms", "ttft_ms", "e2e_ms"} <= set(mine["phases"])
