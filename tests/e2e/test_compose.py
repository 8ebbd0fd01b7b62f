"""The Docker Compose stack for real: build the image on CPU, `up --wait` with 2 prefill and
2 decode replicas and the embedded model, stream a chat request through the published port,
run a short `pdserve bench` against it, read /metrics from the gateway and from a node,
then `down`. It needs a Docker engine: `.ci/run` starts one when CI=true (where this test
must not skip); elsewhere it skips with the reason.

Offline by design: the wheels are downloaded on the host (docker/wheels.sh) and the base
image is PDSERVE_TEST_BASE_IMAGE (CI builds `local/pdserve-python-cc-lb` with debootstrap).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.common.wire.transport import free_port
from tests.docker_util import build_once, compose_or_skip, stack_env

# the first test of the file pays for the stack: the wheels download, the image build and
# `up` (their own timeouts are 900, 900 and 700 s) on a fresh, slow machine, beyond the
# suite's 600 s a test
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Name three colours of the rainbow."
POLL_S = 0.1  # a state polled (registration, KV freed): seen within 0.1 s, not 0.5 s


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
        time.sleep(POLL_S)
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


@dataclass
class Stack:
    url: str
    run: Callable[..., subprocess.CompletedProcess]
    health: dict
    project: str  # the compose project: its containers carry it as a label


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    compose = compose_or_skip()
    port = free_port()
    env = stack_env(ROOT, port, tmp_path_factory.mktemp("models"))  # empty: embedded model
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
    build_once(run)
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
        yield Stack(url, run, health, project)
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


def test_compose_stack_serves_streams_benches_and_reports(stack, smol_runner, tokenizer, tmp_path):
    from tests.conftest import chat_ids, make_engine

    url, run, health = stack.url, stack.run, stack.health
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
            "--out",
            str(tmp_path / "bench"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    summary = json.loads(bench.stdout.strip().splitlines()[-1])
    if summary["completed"] != 12 or summary["failed"] != 0:  # say why, with the gateway's log
        lines = (tmp_path / "bench" / "requests.jsonl").read_text().splitlines()
        errors = [e for line in lines if (e := json.loads(line)["error"])]
        log = run("logs", "--tail", "60", "gateway").stdout[-6000:]
        raise AssertionError(f"{summary}\nerrors: {errors}\ngateway log:\n{log}")

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
    # the image has a compiler and built the C kernels: the node does not run eager ops
    info = [ln for ln in node_metrics.splitlines() if ln.startswith("pdserve:engine_info{")]
    assert len(info) == 1 and 'kernels="fused' in info[0], info

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


def test_compose_stack_survives_a_node_container_killed_and_restarted_under_load(
    stack, smol_runner, tokenizer
):
    """The chaos suite on the real stack: while greedy streams run, the decode container
    running more of them is SIGKILLed and started again through the Docker SDK. Figures
    (printed, asserted): 0 hung, >= 99 % completed, detection <= 2 s (plus the gateway's
    own stalls meanwhile, which extend every lease), every completed text
    equal to the single-process engine's, no KV block in use on any node and the gateway's
    table empty afterwards, the gateway's RSS within 10 % of its level after a warm-up run."""
    import docker

    from pdserve.common.sampling import SamplingParams
    from tests.conftest import make_engine
    from tests.e2e.streams import run_streams

    client = docker.from_env()
    mine = client.containers.list(filters={"label": f"com.docker.compose.project={stack.project}"})
    gateway = next(c for c in mine if c.labels["com.docker.compose.service"] == "gateway")
    by_name = {c.name: c for c in mine}

    def rss_kib() -> int:
        out = gateway.exec_run(["grep", "VmRSS", "/proc/1/status"]).output.decode()
        return int(out.split()[1])

    def nodes() -> dict:
        try:
            with urllib.request.urlopen(f"{stack.url}/health", timeout=2) as resp:
                return dict(json.loads(resp.read())["nodes"])
        except OSError:
            return {}

    def metric(name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"{stack.url}/metrics", timeout=5) as resp:
            return _metric(resp.read().decode(), name, **labels)

    n, spacing, max_tokens = 40, 0.25, 12  # 10 s of load, ~3 requests running per decode node
    prompts = [list(range(500 + 13 * i, 560 + 13 * i + i % 23)) for i in range(n)]
    bodies = [
        {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": True}
        for p in prompts
    ]  # fmt: skip
    assert all(r.ok for r in run_streams(stack.url, bodies, 120, spacing))  # the warm-up
    rss_warm = rss_kib()

    results: list = []
    load = threading.Thread(
        target=lambda: results.extend(run_streams(stack.url, bodies, 120, spacing))
    )
    load.start()
    time.sleep(3.0)
    decodes = [name for name, role in nodes().items() if role == "decode"]
    running = {d: metric("pdserve:num_requests_running", node=d) for d in decodes}
    victim = by_name[max(decodes, key=lambda d: running[d])]
    stalled = metric("pdserve:gateway_stall_seconds_total")
    victim.kill(signal="SIGKILL")
    killed = time.monotonic()
    while victim.name in nodes():
        assert time.monotonic() - killed < 10, "the killed node was never dropped"
        time.sleep(0.02)
    detection = time.monotonic() - killed
    stalled = metric("pdserve:gateway_stall_seconds_total") - stalled
    victim.start()
    deadline = time.monotonic() + 120
    while victim.name not in nodes():
        assert time.monotonic() < deadline, "the restarted node never registered"
        time.sleep(POLL_S)
    load.join(300)
    assert not load.is_alive(), "the load generator itself hung"

    engine = make_engine(smol_runner, tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in engine.generate(prompts, params)]
    hung = [r for r in results if "TimeoutError" in r.error]
    completed = [(e, r) for e, r in zip(expected, results, strict=True) if r.ok]
    wrong = [(e, r.text) for e, r in completed if r.text != e]
    deadline = time.monotonic() + 30
    while metric("pdserve:kv_blocks", state="in_use") or metric(
        "pdserve:gateway_attempts_in_flight"
    ):
        assert time.monotonic() < deadline, "KV left in use or attempts left in the table"
        time.sleep(POLL_S)
    figures = {
        "requests": n,
        "completed_share": round(len(completed) / n, 4),
        "hung": len(hung),
        "wrong_text": len(wrong),
        "detection_s": round(detection, 2),
        "gateway_stalled_s": round(stalled, 2),
        "replacements": metric("pdserve:request_replacements_total"),
        "gateway_rss_vs_warm": round(rss_kib() / rss_warm, 3),
    }
    print(f"\ncompose chaos figures: {figures}")
    assert not hung, [r.error for r in hung[:3]]
    assert not wrong, wrong[:3]
    assert len(completed) >= 0.99 * n, [r.error for r in results if not r.ok][:5]
    # the lease and the gateway's checks, later by what the gateway could not run
    assert detection <= 2.0 + stalled, figures
    assert figures["gateway_rss_vs_warm"] <= 1.10, figures
