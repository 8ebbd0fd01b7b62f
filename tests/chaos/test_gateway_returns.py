"""A gateway frozen past its nodes' heartbeat timeout (a GC or swap pause, CPU starvation,
a throttled container) is silent to them: its requests become orphans, which another gateway
may adopt for a client that resumes there, and which are freed at `--orphan-grace`'s end.
The gateway then wakes with those requests still in its table; nothing it would ever read
again ends them (no token comes, so no write times out), and only the progress lease
(120 s) would, by dropping a healthy node. The node tells it what was taken meanwhile
(common/node/adoption.py, `tell_returned`): a stream adopted elsewhere is hung up here, one
freed is placed again. Real gateway and node processes, SIGSTOP for the freeze; the sim
engine's tokens are a pure function of (seed, position)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import urllib.request

import aiohttp

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import wait_for
from tests.e2e.streams import sim_text
from tests.e2e.test_client_leaves import _read
from tests.e2e.test_half_open import FLAGS, Vanished, _body, _resume

# the stream's node: its own /metrics tells when it found the frozen gateway silent
NODE = "decode-0"
TOKENS = 500  # a 10 s stream at --sim-time-scale 2 (test 2): fewer, slower tokens, as long


def _node_metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name) and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _frozen_until(pid: int, port: int, name: str, **labels: str) -> None:
    """SIGSTOP `pid` until the node's counter `name` moves (then SIGCONT, whatever happens)."""
    before = _node_metric(port, name, **labels)
    os.kill(pid, signal.SIGSTOP)
    try:
        moved = wait_for(lambda: _node_metric(port, name, **labels) > before, 60)
        assert moved, f"{name} never moved while the gateway was frozen"
    except BaseException:
        os.kill(pid, signal.SIGCONT)
        raise


def test_a_stream_resumed_elsewhere_while_its_gateway_was_frozen_is_hung_up_there(
    make_cluster, tokenizer
):
    """The client's connection to gateway A is dead to it (no FIN: it stopped reading). A
    freezes; once the node finds A silent, the client resumes at B, which adopts the stream.
    A wakes: its dead connection is hung up within seconds (the send timeout is 60 s) and the
    stream let go there, while B goes on with the exact text."""
    port = free_port()
    cluster = make_cluster(prefill=1, decode=1, engine="sim", node_flags=FLAGS, gateways=2,
                           extra={NODE: ("--metrics-port", str(port))})  # fmt: skip
    first, other = cluster.urls
    client = Vanished(first, _body(5), True)
    client.read(5)
    pid = cluster.gateways[0].pid
    _frozen_until(pid, port, "pdserve:gateway_silences_total")
    try:  # resumed only now: before, the node would tell A at once (it still answered)
        rest, covered = asyncio.run(_resume(other, client.stream_id, client.last_id))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.text + rest == sim_text(tokenizer, _body(5)["prompt"], 5, covered)
    assert cluster.metric("pdserve:stream_resumes_total", other, outcome="adopted") == 1
    assert wait_for(lambda: cluster.metric("pdserve:requests_total", first,
                                           outcome="detached") == 1, 10)  # fmt: skip
    assert client.ended()  # A closed the dead connection


async def _stream(url: str, body: dict, got: dict) -> None:
    """A client that stays to the stream's end, however long A is frozen."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            got["first"] = await _read(resp, 3)
            got["started"].set()
            got["rest"] = await _read(resp, None)


def test_a_stream_freed_while_its_gateway_was_frozen_is_placed_again_there(make_cluster, tokenizer):
    """A freezes past the heartbeat timeout and the orphan grace (1 s) while its client
    waits on the connection: the node frees the stream. A wakes and is told: the stream is
    placed again (a preemption's re-placement, from prompt and tokens so far) and its client
    gets the rest of the exact text, not a stream that waits for the progress lease."""
    port = free_port()
    # the later flag wins: ~50 tokens/s (a 10 s stream, freed ~3 s in), a 1 s grace
    flags = (*FLAGS, "--sim-time-scale", "2.0", "--orphan-grace", "1")
    cluster = make_cluster(prefill=1, decode=1, engine="sim", node_flags=flags,
                           extra={NODE: ("--metrics-port", str(port))})  # fmt: skip
    body = {**_body(6), "max_tokens": TOKENS}
    got: dict = {"started": threading.Event()}
    client = threading.Thread(target=lambda: asyncio.run(_stream(cluster.url, body, got)))
    client.start()
    assert got["started"].wait(60)
    _frozen_until(cluster.gateways[0].pid, port, "pdserve:orphans_total",
                  outcome="freed_running")  # fmt: skip
    os.kill(cluster.gateways[0].pid, signal.SIGCONT)
    client.join(60)
    assert not client.is_alive(), "the stream never went on after its gateway woke"
    assert got["rest"][3], "no [DONE]"
    text = got["first"][0] + got["rest"][0]  # all of it: no token lost, none twice
    assert text == sim_text(tokenizer, body["prompt"], 6, TOKENS)
    assert cluster.metric("pdserve:request_replacements_total", kind="preempted") == 1
