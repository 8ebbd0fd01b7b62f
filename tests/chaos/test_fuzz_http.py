"""Fuzzing the gateway's HTTP side: generated bad requests against every endpoint of
/openapi.json (1,000 per endpoint; 10,000 with --chaos-long) on a live sim cluster. Every
answer is below 500 and every 4xx is OpenAI's error object, nothing hangs (30 s a request),
the gateway stays up and still serves a correct completion afterwards. Then raw garbage at
the HTTP layer (not HTTP at all, truncated, oversized headers, connections left half-sent).
The figures (status counts, requests/s) are printed."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import Cluster, start_cluster

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GETS = ["/v1/models", "/health", "/metrics", "/openapi.json"]
CASES = 1000  # per endpoint in `make test`; x10 with --chaos-long
FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
    "return_token_ids", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message",
]  # fmt: skip
DELETE = object()

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", ""]) | values},
        optional={"content": st.text(max_size=40) | values},
    )
    | values,
    max_size=3,
)
prompts = st.text(max_size=80) | st.lists(st.integers(-5, 60_000), max_size=30) | values


def _base(path: str) -> dict[str, Any]:
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"prompt": "hi", "max_tokens": 4}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=300))  # not JSON, or not UTF-8
    if kind == 1:
        return json.dumps(draw(values)).encode()  # JSON, not a request
    body = _base(path)
    field = "messages" if path == CHAT else "prompt"
    if draw(st.booleans()):
        body[field] = draw(messages if path == CHAT else prompts)
    names = st.sampled_from([*FIELDS, field, "extra"])
    for name, value in draw(st.dictionaries(names, values | st.just(DELETE), max_size=4)).items():
        if value is DELETE:
            body.pop(name, None)
        else:
            body[name] = value
    _cap(body, path)
    raw = json.dumps(body).encode()
    if kind == 2:  # truncated
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw


def _cap(body: dict[str, Any], path: str) -> None:
    """A valid request asking for thousands of tokens is not a bad request, just a slow one:
    keep the generated ones short."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 16 < value < 10**6:
            body[key] = 16
    if (
        path == CHAT
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
    ):
        body["max_tokens"] = 8  # a chat without a limit may run to the context length


class Client:
    """One keep-alive connection, reopened when the server closed it after an answer."""

    def __init__(self, url: str) -> None:
        self.host, self.port = url.removeprefix("http://").split(":")
        self.conn = self._open()
        self.statuses: Counter[int] = Counter()

    def _open(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, int(self.port), timeout=30)

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=body, headers=headers)
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = self._open()
                self.statuses[resp.status] += 1
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
                self.conn.close()
                self.conn = self._open()
                if attempt:
                    raise
        raise AssertionError("unreachable")


def check_answer(status: int, headers: dict[str, str], data: bytes, stream: bool) -> None:
    assert status < 500, (status, data[:300])
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif stream and headers.get("content-type", "").startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(
        prefill=1,
        decode=1,
        engine="sim",
        node_flags=("--sim-time-scale", "0.02"),
        gateway_flags=("--max-body-bytes", "4096"),
    )
    yield c
    c.stop()


def still_serving(cluster: Cluster) -> None:
    assert all(p.poll() is None for p in cluster.procs), "a process died"
    status, body = cluster.post(COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_generated_bad_bodies_get_4xx_never_5xx(cluster: Cluster, chaos_scale: int, path: str):
    client = Client(cluster.url)
    types = st.sampled_from(["application/json", "text/plain", "", "application/json; x=1"])
    started = time.monotonic()

    @settings(
        max_examples=CASES * chaos_scale,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(path), content_type=types)
    def one(body: bytes, content_type: str) -> None:
        headers = {"Content-Type": content_type} if content_type else {}
        status, got, data = client.request("POST", path, body, headers)
        check_answer(status, got, data, stream=b'"stream": true' in body)

    one()
    took = time.monotonic() - started
    total = sum(client.statuses.values())
    print(f"\nfuzz {path}: {total} requests in {took:.1f} s, statuses {dict(client.statuses)}")
    assert total >= CASES * chaos_scale
    rejected = sum(n for s, n in client.statuses.items() if 400 <= s < 500)
    assert rejected >= total // 2, client.statuses  # most are bad: the fuzzer reaches checks
    still_serving(cluster)


@pytest.mark.parametrize("path", GETS)
def test_generated_requests_to_read_endpoints_never_5xx(
    cluster: Cluster, chaos_scale: int, path: str
):
    client = Client(cluster.url)
    methods = st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    queries = st.text(st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=30)
    header_values = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=40)

    @settings(
        max_examples=CASES * chaos_scale,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        method=methods,
        query=queries,
        body=st.none() | st.binary(max_size=200),
        auth=st.none() | header_values,
        accept=st.none() | header_values,
    )
    def one(method: str, query: str, body: bytes | None, auth: str | None, accept: str | None):
        headers = {k: v for k, v in (("Authorization", auth), ("Accept", accept)) if v is not None}
        target = path + ("?" + query.replace(" ", "%20").replace("#", "%23") if query else "")
        status, got, data = client.request(method, target, body, headers)
        assert status < 500, (method, target, status, data[:200])
        if method in ("GET", "HEAD"):
            assert status in (200, 503), (method, target, status)  # 503: /health, no node
        else:
            assert status == 405 and got.get("allow"), (method, status)

    one()
    print(f"\nfuzz {path}: statuses {dict(client.statuses)}")
    assert sum(client.statuses.values()) >= CASES * chaos_scale


def test_raw_garbage_at_the_http_layer_changes_nothing(cluster: Cluster, chaos_scale: int):
    """Bytes that are not HTTP, truncated requests, huge headers and many connections left
    half-sent: each gets a 4xx or a closed connection, and the gateway keeps serving."""
    host, port = cluster.url.removeprefix("http://").split(":")
    valid = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n"
    valid += b'{"prompt": "hi", "max_tokens": 2}'
    garbage = [
        b"\x00\xff" * 100,
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /health HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 5_000 + b"\r\n",
        valid[:40],
        valid,  # a length that disagrees with the body
    ]
    half_open = []
    for i in range(20 * chaos_scale):
        payload = garbage[i % len(garbage)]
        # 3 s: a body shorter than its Content-Length is held by the server, never answered,
        # and this wait is all that costs; an answer that comes later is not needed
        sock = socket.create_connection((host, int(port)), timeout=3)
        try:
            sock.sendall(payload)
        except OSError:
            pass  # the server closed it mid-send: fine
        if i % 3 == 0:
            half_open.append(sock)  # left open, sent half or nothing more
            continue
        try:
            answer = sock.recv(200)
        except (TimeoutError, ConnectionError):
            answer = b""
        if answer:
            status = int(answer.split(b" ", 2)[1])
            assert 400 <= status < 500 or answer.startswith(b"HTTP/1.1 200"), answer
        sock.close()
    still_serving(cluster)  # while the half-open connections are still held
    for sock in half_open:
        sock.close()
    still_serving(cluster)


def _raw(cluster: Cluster, request: bytes) -> int:
    """The status of one raw HTTP/1.1 exchange (the connection closed after it)."""
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = sock.recv(200)
    return int(answer.split(b" ", 2)[1])


def test_a_body_in_a_lying_content_encoding_gets_400(cluster: Cluster):
    """A body that is not in the Content-Encoding it names failed aiohttp's decoder in the
    handler: a 500 and a logged traceback per request."""
    body = b"not compressed at all"
    for encoding in ("gzip", "deflate", "br", "zstd", "x-unknown"):
        head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n")  # fmt: skip
        status = _raw(cluster, head.encode() + body)
        assert 400 <= status < 500, (encoding, status)
    still_serving(cluster)
