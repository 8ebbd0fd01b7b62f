"""A request whose KV cannot reach its decode node: the prefill node sent the first token,
then its KV waits on a link to the decode node that drops every packet (an iptables rule
on loopback for the decode node's data port, the only path cut: both nodes still reach the
gateway and go on with their other work, so no node's progress lease fires). The gateway
places it again after `--progress-timeout` (gateway/liveness.py); with the link still cut,
every attempt stalls, and the request ends with a 503 once it has lost its node
`--max-replacements` times, its KV freed on both nodes. Before, it waited forever, its
blocks held. With the link back, a request streams its exact text.

Needs root and iptables; the rule names one port on loopback and is removed at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import wait_for
from tests.e2e.streams import sim_text

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None
    or subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True).returncode != 0,
    reason="needs root and iptables",
)  # fmt: skip
PROGRESS_S = 2.0


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _rule(op: str, port: int) -> None:
    subprocess.run(["iptables", op, "INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port),
                    "-j", "DROP"], check=True, capture_output=True, timeout=30)  # fmt: skip


def test_a_kv_hand_off_that_cannot_complete_ends_the_request_and_frees_its_kv(
    make_cluster, tokenizer
):
    data_port = free_port()
    cluster = make_cluster(
        engine="sim",
        gateway_flags=("--progress-timeout", str(PROGRESS_S)),
        node_flags=("--sim-time-scale", "0.1", "--kv-backend", "zmq"),
        extra={"decode-0": ("--data-port", str(data_port))},
    )
    body = {"prompt": list(range(1000, 1100)), "max_tokens": 20, "seed": 3,
            "temperature": 1.0, "ignore_eos": True}  # fmt: skip
    _rule("-I", data_port)
    try:
        started = time.monotonic()
        status, answer = _post(f"{cluster.url}/v1/completions", body)
        took = time.monotonic() - started
        assert status == 503, answer
        assert "lost its node 4 times" in answer["error"]["message"]
        print(f"\nended after {took:.1f} s")
        # four attempts, each placed again once its hand-off had stalled for the timeout
        assert took >= 4 * PROGRESS_S
        assert cluster.metric("pdserve:request_replacements_total", kind="lost") == 3
        assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, 10)
    finally:
        _rule("-D", data_port)
    status, answer = _post(f"{cluster.url}/v1/completions", body)
    assert status == 200, answer
    text = answer["choices"][0]["text"]
    assert text == sim_text(tokenizer, body["prompt"], 3, 20)
