"""Cluster behaviour with real processes: capacity and placement, disconnects, preemption,
registration refusals, node loss, gateway restart and drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.common.sampling import SamplingParams
from tests.conftest import make_engine
from tests.e2e.conftest import start_cluster, wait_for, wait_up
from tests.e2e.streams import sim_text


def in_use(cluster, role: str) -> float:
    return cluster.metric("pdserve:kv_blocks", role=role, state="in_use")


def test_short_placement_timeout_answers_503_with_retry_after(make_cluster):
    # the first request placed within 1 s (an offer's round trip), the others waiting for
    # the one slot longer than that: a 4,000-token pass is 2.6 s at this scale
    cluster = make_cluster(
        engine="sim",
        gateway_flags=("--placement-timeout", "1.0"),
        node_flags=("--max-batch", "1", "--sim-time-scale", "20"),
    )
    body = {"prompt": list(range(100, 4100)), "max_tokens": 2}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cluster.post("/v1/completions", body), range(4)))
    statuses = sorted(status for status, _ in results)
    assert statuses[0] == 200 and statuses[-1] == 503
    failed = next(r for status, r in results if status == 503)
    assert failed["error"]["code"] == "service_unavailable"
    assert "retry" in failed["error"]["message"]


def test_small_decode_cache_preempts_and_every_request_completes(
    make_cluster, smol_runner, tokenizer
):
    # 4 sequences of 9 + 16 tokens, each a second block of 16 from its 8th token on: 5
    # blocks make the decode node preempt once three run past it (measured: 2 each run)
    cluster = make_cluster(node_flags=("--num-kv-blocks", "5"))
    prompts = [tokenizer.encode(f"Story number {i}: once upon a time") for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = make_engine(smol_runner, tokenizer).generate(prompts, params)

    def complete(p):
        return cluster.post(
            "/v1/completions",
            {"prompt": p, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(complete, prompts))
    for (status, resp), exp in zip(results, expected, strict=True):
        assert status == 200, resp
        assert resp["usage"]["completion_tokens"] == 16
        assert resp["choices"][0]["text"] == exp.text
    assert cluster.metric("pdserve:request_replacements_total") > 0
    assert wait_for(lambda: in_use(cluster, "decode") == 0)


def test_pdserve_up_stops_every_child():
    """Two nodes of each role (one `up`, not one per role: a process start each saved)."""
    from pdserve.common.wire.transport import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--engine",
        "sim",
        "--port",
        str(port),
        "--control-port",
        str(free_port()),
        "--tokens-port",
        str(free_port()),
        "--prefill",
        "2",
        "--decode",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_up(proc)
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 5  # gateway + 2 + 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        alive = [c for c in children if subprocess.run(["kill", "-0", c]).returncode == 0]
        assert alive == []
        with socket.socket() as s:  # nothing listens any more (TIME_WAIT is fine, as for servers)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_ctrl_c_stops_pdserve_up_at_once():
    """The first Ctrl-C drains: nodes first (a decode node decodes its streams on, up to its
    --drain-timeout), the gateways after them. A second one ends it now, as every server's
    does: it was ignored, the cluster killed only 10 s later."""
    from pdserve.common.wire.transport import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "up", "--engine", "sim",
           "--port", str(port), "--control-port", str(free_port()), "--tokens-port",
           str(free_port()), "--sim-time-scale", "40", "--drain-timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_up(proc)
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True,
                           "stream": True}).encode()  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        stream = urllib.request.urlopen(request, timeout=30)
        assert stream.readline().startswith(b"data:")  # its first token: decoding now
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline()
        while line and "draining" not in line:  # the decode node drains its stream on
            line = proc.stdout.readline()
        assert "draining" in line
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        assert time.monotonic() - start < 5.0
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("backend", ["zmq", "tcp"])
def test_decode_node_dying_mid_transfer_frees_prefill_kv_and_retries_elsewhere(
    make_cluster, backend
):
    # slow modelled time: a 4,000-token prefill takes ~1.5 s while its layers stream out
    cluster = make_cluster(
        engine="sim", decode=2, node_flags=("--sim-time-scale", "15", "--kv-backend", backend)
    )
    body = {"prompt": list(range(100, 4100)), "max_tokens": 5, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(cluster.post, "/v1/completions", body)

        # the chosen decode node reserves blocks at the KV header, while the prefill runs
        def receiving() -> list[str]:
            return [
                f"decode-{i}"
                for i in range(2)
                if cluster.metric("pdserve:kv_blocks", node=f"decode-{i}", state="in_use") > 0
            ]

        assert wait_for(lambda: len(receiving()) == 1, timeout=5)
        victim = receiving()[0]
        cluster.procs[2 + int(victim[-1])].kill()  # procs: gateway, prefill-0, decode-0, -1
        # mid-prefill (the gateway sees the prefill's load at its next heartbeat, 0.2 s)
        assert wait_for(  # within the ~1.5 s of the pass left after the kill
            lambda: cluster.metric("pdserve:num_requests_running", role="prefill") > 0, 1.5
        )
        status, resp = future.result(timeout=60)
    assert status == 200 and resp["usage"]["completion_tokens"] == 5
    assert cluster.metric("pdserve:request_replacements_total", kind="lost") >= 1
    assert cluster.metric("pdserve:kv_transfer_bytes_total", backend=backend) > 0  # the retry
    assert wait_for(lambda: in_use(cluster, "prefill") == 0, timeout=8)


# -- one sim cluster shared by the tests below (last in the file: it lives only while they
# run); each leaves it as it found it: every node registered, the gateway serving, nothing
# held. One slot per node, ~10 ms decode steps, tiny KV frames (long prompts move little).
@pytest.fixture(scope="module")
def sim_cluster():
    flags = ("--max-batch", "1", "--sim-time-scale", "1", "--sim-kv-scale", "0.001")
    cluster = start_cluster(engine="sim", node_flags=flags)
    yield cluster
    cluster.stop()


def test_full_prefill_nodes_make_requests_wait_and_all_complete(sim_cluster, tokenizer):
    # placement, not the model: each 4,000-token pass ~0.13 s, so the six offers come while
    # the one slot is taken
    cluster = sim_cluster
    rejects = cluster.metric("pdserve:placement_rejects_total", node="prefill-0")
    accepts = cluster.metric("pdserve:placement_accepts_total", node="prefill-0")
    prompt = list(range(1000, 5000))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: cluster.post("/v1/completions", body), range(6)))
    assert [status for status, _ in results] == [200] * 6
    # the same greedy text, the exact one (the sim's greedy tokens depend on no seed)
    assert {r["choices"][0]["text"] for _, r in results} == {sim_text(tokenizer, prompt, 0, 8)}
    assert cluster.metric("pdserve:placement_rejects_total", node="prefill-0") > rejects
    assert cluster.metric("pdserve:placement_accepts_total", node="prefill-0") == accepts + 6


def test_client_disconnect_frees_kv_on_both_nodes_at_once(sim_cluster):
    # the gateway's and the nodes' part, not the model's: sim nodes, ~10 ms a decode step
    cluster = sim_cluster
    assert wait_for(lambda: in_use(cluster, "decode") == 0 and in_use(cluster, "prefill") == 0)
    body = json.dumps(
        {"prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    received = b""
    while received.count(b"data: ") < 5:
        received += sock.recv(65536)
    assert wait_for(lambda: in_use(cluster, "decode") > 0, timeout=5)
    sock.close()
    closed = time.monotonic()
    assert wait_for(
        lambda: in_use(cluster, "decode") == 0 and in_use(cluster, "prefill") == 0, timeout=10
    )
    # freed at the next decode step, seen at the next 0.2 s heartbeat: 0.3-0.4 s on an idle
    # 2-vCPU host. Kept instead, the blocks would stay until the 2,000 tokens are decoded
    # (18 s of modelled steps), so 5 s tells the two apart on a host 10x slower than idle
    assert time.monotonic() - closed < 5.0


def test_sim_nodes_serve_without_loading_torch(sim_cluster):
    """The sim engine is for scale experiments: its nodes (and the gateway) start and serve
    without torch, which costs each process ~1.5 s and ~300 MB (no torch cache, so the direct
    KV backends are not offered)."""
    cluster = sim_cluster
    status, resp = cluster.post("/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert status == 200, resp
    for proc in cluster.procs:
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "libtorch" not in f.read(), proc.args


def test_silent_node_is_dropped_and_rejoins(sim_cluster):
    cluster = sim_cluster
    decode = cluster.procs[2]
    decode.send_signal(signal.SIGSTOP)
    try:
        stalled = cluster.metric("pdserve:gateway_stall_seconds_total")
        stopped = time.monotonic()
        assert wait_for(lambda: cluster.get("/health")[0] == 503, timeout=10)
        took = time.monotonic() - stopped
        # the 2 s lease and the gateway's 0.25 s checks; later by what the gateway itself
        # could not run (a loaded host: its leases are extended by as much)
        stalled = cluster.metric("pdserve:gateway_stall_seconds_total") - stalled
        assert took < 2.0 + 1.0 + stalled, (took, stalled)
        assert "decode" in cluster.get("/health")[1]
    finally:
        decode.send_signal(signal.SIGCONT)
    assert wait_for(lambda: cluster.get("/health")[0] == 200, timeout=5)
    status, _ = cluster.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200


def test_nodes_register_again_after_a_gateway_restart(sim_cluster):
    cluster = sim_cluster
    gateway = cluster.procs[0]
    args = gateway.args
    gateway.send_signal(signal.SIGTERM)
    gateway.wait(10)
    cluster.procs[0] = subprocess.Popen(args)
    # a fresh process's imports, then the nodes' re-registering (~2.5 s idle on 2 vCPUs)
    assert wait_for(lambda: cluster.get("/health")[0] == 200, timeout=60)
    status, resp = cluster.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200 and resp["usage"]["completion_tokens"] == 3


def test_duplicate_node_id_is_refused(sim_cluster):
    proc = sim_cluster.add_node("decode", "decode-0", "--data-port", "0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "already registered" in out
    assert sim_cluster.get("/health")[0] == 200  # the registered decode-0 serves on


def test_sigterm_drains_a_decode_node_without_losing_its_stream(sim_cluster):
    """The last of the shared cluster's tests: its decode node is gone after it."""
    cluster = sim_cluster
    body = {"prompt": "hello", "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(cluster.post, "/v1/completions", body)
        assert wait_for(
            lambda: cluster.metric("pdserve:num_requests_running", role="decode") > 0, timeout=5
        )
        decode = cluster.procs[2]
        decode.send_signal(signal.SIGTERM)
        status, resp = future.result(timeout=60)
    assert status == 200 and resp["usage"]["completion_tokens"] == 60
    assert decode.wait(30) == 0
