"""A client that vanishes without closing its connection (its host or network gone: no FIN
reaches the gateway) neither holds its stream for TCP's many-minute timeout nor keeps it
from being resumed (gateway/sse.py, docs/architecture.md "Several gateways"): a chunk it
does not take within `--send-timeout` ends the connection (a resumable stream is then let
go for a resume, another freed with its KV), and a resume of the stream, at the same
gateway or another, hangs the dead connection up at once and goes on exactly. The vanished
client is a real socket that stops reading and never closes. Real gateway and node
processes; the sim engine's tokens are a pure function of (seed, position)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from tests.e2e.conftest import start_cluster, wait_for
from tests.e2e.streams import sim_text
from tests.e2e.test_client_leaves import _held, _read

TOKENS = 20_000  # far more than the stall needs: a stream never ends within a test
# --drain-timeout 1: the streams never end, so a node stopped at teardown would decode on for
# the 30 s default drain (the fixture kills it at 10 s): it hands them back after 1 s instead
FLAGS = ("--sim-time-scale", "0.1", "--num-kv-blocks", "4096", "--orphan-grace", "30",
         "--drain-timeout", "1")  # fmt: skip


def _body(seed: int) -> dict:
    return {"prompt": list(range(1000, 1300)), "max_tokens": TOKENS, "seed": seed,
            "temperature": 1.0, "ignore_eos": True, "stream": True}  # fmt: skip


class Vanished:
    """A client over a raw socket (a 4 KiB receive buffer) that reads the stream's first
    events, then reads nothing and keeps the connection open: to the gateway, a peer gone
    without a FIN (its writes back up). What it holds is what it read whole."""

    def __init__(self, url: str, body: dict, resumable: bool) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect((host, int(port)))
        payload = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        head += "pdserve-resumable: 1\r\n" if resumable else ""
        head += f"Content-Length: {len(payload)}\r\n\r\n"
        self.sock.sendall(head.encode() + payload)
        self.text, self.stream_id, self.last_id = "", "", "0"

    def read(self, events: int) -> None:
        data = b""
        while data.count(b"\n\n") < events:  # the head ends in \r\n\r\n
            data += self.sock.recv(1024)
        _, _, stream = data.partition(b"\r\n\r\n")
        for event in stream.split(b"\n\n")[:events]:
            fields = dict(line.split(b": ", 1) for line in event.split(b"\n") if b": " in line)
            chunk = json.loads(fields[b"data"])
            self.stream_id = chunk["id"]
            self.last_id = fields.get(b"id", b"0").decode()
            self.text += chunk["choices"][0]["text"]

    def ended(self) -> bool:
        """Whether the gateway ended the connection (read what is left until EOF or RST)."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True


async def _resume(url: str, stream_id: str, last_id: str) -> tuple[str, int]:
    """40 more events of the stream from `last_id`, and the tokens covered then."""
    async with aiohttp.ClientSession() as session:
        for _ in range(40):  # 409 while its gateway lets it go
            async with session.get(f"{url}/v1/streams/{stream_id}",
                                   headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
                if resp.status == 409:
                    await asyncio.sleep(0.25)
                    continue
                assert resp.status == 200, (resp.status, await resp.text())
                text, _, covered, _ = await _read(resp, 40)
                return text, int(covered)
    raise AssertionError(f"{stream_id} was never resumed at {url}")


def _outcomes(cluster, url: str, outcome: str) -> float:
    return cluster.metric("pdserve:requests_total", url, outcome=outcome)


def _cluster(**kwargs):
    cluster = start_cluster(prefill=1, decode=1, engine="sim", node_flags=FLAGS, **kwargs)
    yield cluster
    cluster.stop()


# Each class's tests share one cluster (counting their own outcomes), stopped as the class
# ends: a stream left to its node decodes on (an orphan, for the grace), and it must not
# burn CPU through the other class's tests.
@pytest.fixture(scope="class")
def timeouts():
    """One gateway with short send and body timeouts (each test uses one of them)."""
    yield from _cluster(gateway_flags=("--send-timeout", "1", "--body-timeout", "1"))


@pytest.fixture(scope="class")
def two_gateways():
    yield from _cluster(gateways=2)


def _post_head(url: str, payload: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode())
    return sock


class TestShortTimeouts:
    """The body test first: the vanished test leaves a stream decoding (its orphan)."""

    def test_a_body_that_stalls_gets_408_and_a_slow_one_that_moves_is_served(self, timeouts):
        """`--body-timeout 1`: a client that sends its body's first bytes, then nothing, is
        answered 408 once no byte has come for the timeout (before it, the handler held only the
        read: nothing is placed before the whole body) and its connection is closed; a body
        that trickles in a byte every 20 ms, 2 s and more in all, is read and served."""
        cluster = timeouts
        url = cluster.urls[0]
        ok = _outcomes(cluster, url, "ok")
        payload = json.dumps({"prompt": list(range(1000, 1030)), "max_tokens": 4}).encode()
        stalled = _post_head(url, payload)
        stalled.sendall(payload[:10])
        start = time.monotonic()
        answer = stalled.recv(4096)
        waited = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"stalled for 1 s" in answer
        # it waited for the idle bound (asyncio's timer: not earlier, to its clock's grain), and
        # it was the flag's 1 s, not the 60 s default
        assert 0.95 <= waited < 30, waited

        slow = _post_head(url, payload)
        began = time.monotonic()
        for i in range(len(payload)):
            slow.sendall(payload[i : i + 1])
            time.sleep(0.02)
        assert time.monotonic() - began > 2.0  # twice the idle bound in all, never 1 s idle
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["usage"]["completion_tokens"] == 4
        assert _outcomes(cluster, url, "ok") == ok + 1
        stalled.settimeout(30)  # aiohttp reads on for up to 10 s (lingering close), then closes
        while stalled.recv(4096):
            pass

    def test_a_vanished_client_is_let_go_after_the_send_timeout(self, timeouts, tokenizer):
        """`--send-timeout 1`: the stream a vanished client no longer takes ends its connection
        a second after its writes back up: a resumable one is let go to its node (detached) and
        resumes exactly on a new connection; a plain one is freed with its KV, both long
        before their 20,000 tokens end."""
        cluster = timeouts
        url = cluster.urls[0]
        before = {o: _outcomes(cluster, url, o) for o in ("detached", "cancelled", "ok")}

        def counted(outcome: str) -> float:
            return _outcomes(cluster, url, outcome) - before[outcome]

        kept, plain = Vanished(url, _body(1), True), Vanished(url, _body(2), False)
        kept.read(5)
        plain.read(5)
        start = time.monotonic()
        assert wait_for(lambda: counted("detached") == 1, 60)
        assert wait_for(lambda: counted("cancelled") == 1, 60)
        print(f"\nboth let go {time.monotonic() - start:.1f} s after their clients stalled")
        assert counted("ok") == 0  # none ended
        assert kept.ended() and plain.ended()  # the gateway closed both connections
        rest, covered = asyncio.run(_resume(url, kept.stream_id, kept.last_id))
        assert kept.text + rest == sim_text(tokenizer, _body(1)["prompt"], 1, covered)
        # the plain one's KV is freed; the resumed one runs on (held: exactly one)
        assert wait_for(lambda: _held(cluster, url) == 1, 10)


class TestResumes:
    @pytest.mark.parametrize("where", ["same", "other"])
    def test_a_resume_hangs_up_the_dead_connection_at_once(self, two_gateways, tokenizer, where):
        """The client of a resumable stream vanished (no FIN, default --send-timeout of 60 s);
        it resumes at the same gateway, or at another (whose node tells the serving gateway:
        `Wanted`): the dead connection is hung up at once and the text goes on exactly."""
        cluster = two_gateways
        start_at, resume_at = cluster.urls[0], cluster.urls[0 if where == "same" else 1]
        detached_before = _outcomes(cluster, start_at, "detached")
        adopted_before = cluster.metric(
            "pdserve:stream_resumes_total", resume_at, outcome="adopted"
        )
        client = Vanished(start_at, _body(3), True)
        client.read(5)
        began = time.monotonic()
        rest, covered = asyncio.run(_resume(resume_at, client.stream_id, client.last_id))
        took = time.monotonic() - began
        print(f"\nresumed at the {where} gateway in {took:.2f} s")
        assert took < 10  # not the 60 s send timeout (idle: 0.1-0.2 s)
        assert client.ended()  # the dead connection was hung up
        assert client.text + rest == sim_text(tokenizer, _body(3)["prompt"], 3, covered)
        # let go: the dead connection's stream, and (same gateway) the resumed one's when this
        # test's client left it after 40 events
        detached = 2 if where == "same" else 1
        assert wait_for(
            lambda: _outcomes(cluster, start_at, "detached") - detached_before == detached, 10
        )
        adopted = cluster.metric("pdserve:stream_resumes_total", resume_at, outcome="adopted")
        assert adopted - adopted_before == 1
