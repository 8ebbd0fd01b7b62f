"""Two gateways behind HAProxy in Docker Compose (compose.ha.yaml), for real: both gateways
have every node registered, greedy text through the balancer equals the single-process
engine's, a resumable stream whose connection drops resumes through the balancer with the
whole text, and with one gateway container killed the balancer sends everything to the other
and no request fails. Needs a Docker engine (as tests/e2e/test_compose.py; in CI it runs)."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.common.wire.transport import free_port
from pdserve.loadgen.resumable import parse_event
from tests.docker_util import build_once, compose_or_skip, stack_env
from tests.e2e.test_compose import PROMPT, _stream_chat, _wait_nodes

# the first test of the file pays for the stack: the wheels download, the image build and
# `up` (their own timeouts are 900, 900 and 700 s) on a fresh, slow machine, beyond the
# suite's 600 s a test
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
HEALTH_ANY = (  # the body of a 503 too
    "import urllib.request as u, urllib.error as e\n"
    "try:\n    print(u.urlopen('http://127.0.0.1:8000/health', timeout=5).read().decode())\n"
    "except e.HTTPError as x:\n    print(x.read().decode())"
)
HEALTH = (
    "import urllib.request as u, json; "
    "print(json.dumps(json.loads(u.urlopen('http://127.0.0.1:8000/health', timeout=5).read())))"
)


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    compose = compose_or_skip()
    port = free_port()
    env = stack_env(ROOT, port, tmp_path_factory.mktemp("models"))  # empty: embedded model
    project = f"pdserve-ha-{secrets.token_hex(3)}"
    files = ["-f", "compose.yaml", "-f", "compose.cpu.yaml", "-f", "compose.ha.yaml"]
    base = [*compose, "-p", project, *files]

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        done = subprocess.run([*base, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        out = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0, f"{' '.join(args)}:\n{out}"
        return done

    build_once(run)
    try:
        run("up", "-d", "--wait", "--wait-timeout", "600", timeout=700)
        url = f"http://127.0.0.1:{port}"
        _wait_nodes(url, 2, timeout=120)
        yield url, run
    finally:
        logs = subprocess.run([*base, "logs", "--no-color"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        Path(ROOT / "build").mkdir(exist_ok=True)
        (ROOT / "build/compose-ha-test.log").write_text(logs.stdout + logs.stderr)
        subprocess.run([*base, "down", "-v", "--remove-orphans", "--timeout", "20"], cwd=ROOT,
                       env=env, capture_output=True, timeout=300)  # fmt: skip


def test_two_gateways_behind_haproxy_serve_and_survive_one_gone(ha, smol_runner, tokenizer):
    from pdserve.common.sampling import SamplingParams
    from tests.conftest import chat_ids, make_engine

    url, run = ha
    for service in ("gateway", "gateway-b"):  # every node registered with each gateway
        health = json.loads(run("exec", "-T", service, "python3", "-c", HEALTH).stdout)
        assert sorted(health["nodes"].values()) == ["decode", "prefill"], (service, health)
    engine = make_engine(smol_runner, tokenizer)
    [expected] = engine.generate(
        [chat_ids(tokenizer, PROMPT)], SamplingParams(max_tokens=24, temperature=0.0)
    )
    for _ in range(4):  # spread over both gateways by the balancer
        text, _, _ = _stream_chat(url)
        assert text == expected.text
    # a resumable stream whose connection through the balancer drops while both gateways
    # live: resumed through the balancer (whichever gateway it lands on), the text is whole
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    [longer] = engine.generate([chat_ids(tokenizer, PROMPT)], params)
    assert _dropped_and_resumed(url) == longer.text
    run("kill", "gateway-b")
    gone = time.monotonic()
    for _ in range(6):  # the balancer's check (1 s, 2 failures) or its redispatch: no error
        text, _, _ = _stream_chat(url)
        assert text == expected.text
    print(f"compose ha: served through one gateway {time.monotonic() - gone:.1f} s after the kill")


def test_a_node_restarts_while_the_first_gateway_is_stopped(ha, smol_runner, tokenizer):
    """The nodes joined the first gateway's IPC namespace (same-host KV): with that container
    stopped, Docker refused to start any node ("cannot join IPC of a non running
    container"). They share a container of their own now: a node restarts, registers with
    the other gateway and serves through the balancer."""
    from pdserve.common.sampling import SamplingParams
    from tests.conftest import chat_ids, make_engine

    url, run = ha
    run("start", "gateway-b")  # (restarted by its policy after the kill above: a no-op)
    run("stop", "gateway")
    run("restart", "decode", timeout=300)  # the model loads again: up to a few minutes

    def nodes_at_b() -> list[str]:  # /health is 503 until a decode node is back: read both
        done = run("exec", "-T", "gateway-b", "python3", "-c", HEALTH_ANY)
        return sorted(json.loads(done.stdout)["nodes"].values())

    deadline = time.monotonic() + 240
    while nodes_at_b() != ["decode", "prefill"]:
        assert time.monotonic() < deadline, nodes_at_b()
        time.sleep(1)
    engine = make_engine(smol_runner, tokenizer)
    [expected] = engine.generate(
        [chat_ids(tokenizer, PROMPT)], SamplingParams(max_tokens=24, temperature=0.0)
    )
    _wait_nodes(url, 2, timeout=60)  # the balancer's check saw gateway-b healthy again
    for _ in range(3):  # the balancer skips the stopped gateway (its check, or redispatch)
        text, _, _ = _stream_chat(url)
        assert text == expected.text


def _dropped_and_resumed(url: str) -> str:
    """A resumable greedy chat stream of 48 tokens, its connection closed after 4 events,
    then resumed through `url` with the last event's id: the whole text."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "pdserve-resumable": "1"},
    )  # fmt: skip
    resp = urllib.request.urlopen(request, timeout=120)
    raw = b""
    while raw.count(b"\n\n") < 4:
        raw += resp.read1(65536)
    resp.close()  # the client leaves; both gateways live on
    events = [parse_event(e) for e in raw.split(b"\n\n")[:4]]
    last_id, payload = events[-1]
    stream_id = json.loads(payload)["id"]
    text = "".join(_content(p) for _, p in events)
    for _ in range(40):  # 409 until the gateway sees its client gone and lets go
        resume = urllib.request.Request(f"{url}/v1/streams/{stream_id}",
                                        headers={"Last-Event-ID": last_id})  # fmt: skip
        try:
            with urllib.request.urlopen(resume, timeout=120) as again:
                rest = again.read()
        except urllib.error.HTTPError as err:
            assert err.code == 409, (err.code, err.read()[:300])
            time.sleep(0.25)
            continue
        for _, data in (parse_event(e) for e in rest.split(b"\n\n") if e):
            if data and data != b"[DONE]":
                text += _content(data)
        return text
    raise AssertionError(f"{stream_id} was never resumable")


def _content(payload: bytes | None) -> str:
    chunk = json.loads(payload or b"{}")
    return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
