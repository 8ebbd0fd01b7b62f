"""The load generator's streams as servers send them: SSE framing the spec allows, error
events, streams cut short, refusals before the stream, a gateway gone, and a client that
sent late."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.loadgen import runner, workloads
from pdserve.loadgen.client import send
from pdserve.loadgen.metrics import RequestRecord, summarize
from pdserve.loadgen.resumable import StreamLost, resumable_chunks, sse_events
from tests.unit.test_loadgen import completions_server

SPEC = workloads.RequestSpec(0.0, [5, 6, 7], 2, 3)
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
# CRLF framing, a comment, a payload split over two data lines, and an id: all the SSE spec's
CRLF = (b': hello\r\nid: 1\r\ndata: {"choices": [{"text": "a"}],\r\ndata:  "id": "x"}\r\n\r\n'
        b'id: 2\rdata: {"choices": [{"text": "b"}]}\r\r'
        b'data: {"choices": [], "usage": ' + orjson.dumps(USAGE) + b"}\n\n"
        b"data: [DONE]\r\n\r\n")  # fmt: skip
EVENTS = [("1", b'{"choices": [{"text": "a"}],\n "id": "x"}'),
          ("2", b'{"choices": [{"text": "b"}]}'),
          (None, b'{"choices": [], "usage": ' + orjson.dumps(USAGE) + b"}"),
          (None, b"[DONE]")]  # fmt: skip


class _Reads:
    """A response body that arrives in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


async def _events(pieces: list[bytes]) -> list:
    return [e async for e in sse_events(_Reads(pieces))]  # type: ignore[arg-type]


async def test_sse_events_of_any_line_ending_and_of_several_data_lines_split_anywhere():
    """Events were split on \\n\\n alone (a CRLF server's stream was one event that never
    ended) and kept only the last `data:` line of an event."""
    assert await _events([CRLF]) == EVENTS
    for cut in range(1, len(CRLF)):  # a read ending at every byte, a \r before its \n too
        assert await _events([CRLF[:cut], CRLF[cut:]]) == EVENTS, cut
    assert await _events([bytes([b]) for b in CRLF]) == EVENTS


def _sse(body: bytes) -> Callable:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        return resp

    return handler


async def _send(body: bytes, **kwargs) -> RequestRecord:
    async with completions_server(_sse(body)) as url, aiohttp.ClientSession() as session:
        return await send(session, url, None, SPEC, 0, True, 10.0, **kwargs)


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"id": "cmpl-x", "choices": [{"text": text}]}) + b"\n\n"


async def test_a_crlf_stream_is_read_whole():
    record = await _send(CRLF)
    assert record.ok and len(record.chunk_times) == 2 and record.output_tokens == 2


async def test_an_error_event_without_a_message_fails_the_request():
    """`{"error": {"message": ""}}` left the error "": the request counted as good."""
    record = await _send(_chunk("a") + b'data: {"error": {"message": ""}}\n\ndata: [DONE]\n\n')
    assert not record.ok and record.error == "error event"


async def test_a_stream_closed_before_done_is_a_failure():
    """A server gone mid-stream (the body ended, no [DONE]) counted as a complete answer on
    the plain path; the resumable one takes it for a drop."""
    record = await _send(_chunk("a") + _chunk("b"))
    assert not record.ok and "without [DONE]" in record.error
    assert (await _send(_chunk("a") + _chunk("b") + b"data: [DONE]\n\n")).ok
    # a last chunk with its finish reason ends it too (llama.cpp builds without [DONE])
    end = b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
    assert (await _send(_chunk("a") + end)).ok


async def test_a_refusal_before_a_resumable_stream_keeps_its_status():
    """A 503 or 429 to the first POST of a resumable stream was recorded as status 0."""
    for status in (503, 429):

        async def busy(request: web.Request, status=status) -> web.Response:
            return web.Response(status=status, text="overloaded")

        async with completions_server(busy) as url, aiohttp.ClientSession() as session:
            record = await send(session, url, None, SPEC, 0, True, 10.0, others=[url])
        assert (record.status, record.ok) == (status, False) and "overloaded" in record.error


def _refused_url() -> str:
    with socket.socket() as s:  # a port bound, then let go: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _resuming_gateway(busy: int) -> AsyncIterator[tuple[str, list[str]]]:
    """A gateway whose POST breaks off after one chunk, and whose resume answers 409 (no
    pause) `busy` times, then the rest; yields its URL and the paths it was asked."""
    asked: list[str] = []

    async def resume(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        if asked.count(request.path) <= busy:
            return web.Response(status=409, headers={"Retry-After": "0"})
        return await _sse(b"id: 2\n" + _chunk("b") + b"data: [DONE]\n\n")(request)

    app = web.Application()
    app.router.add_post("/v1/completions", _sse(b"id: 1\n" + _chunk("a")))
    app.router.add_get("/v1/streams/{rid}", resume)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), asked
    finally:
        await server.close()


async def test_a_gateway_that_refuses_the_connection_is_not_asked_again():
    """Retries went round every URL, a dead gateway's too: with one of two gone, every
    other attempt was a refused connection, and a stream that needed a few asks was lost."""
    async with _resuming_gateway(busy=2) as (live, asked), aiohttp.ClientSession() as session:
        resumed = [0]
        chunks = [c async for c in resumable_chunks(session, [live, _refused_url()],
                                                    "/v1/completions", {}, 10.0, attempts=4,
                                                    resumed=resumed)]  # fmt: skip
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]
    assert asked == ["/v1/streams/cmpl-x"] * 3 and resumed == [4]
    from pdserve.loadgen.resumable import next_url

    refused = aiohttp.ClientConnectorError(None, ConnectionRefusedError(111, "refused"))  # type: ignore[arg-type]
    alone = ["a"]  # the last one left is kept: it may be back
    assert next_url(alone, "a", refused) == "a" and alone == ["a"]


async def test_a_client_that_sends_late_says_so(monkeypatch):
    """TTFT is timed from the send (as vLLM's benchmark does), so a client that fell behind
    the arrivals (a loaded host) hid its lag; the summary gives the send lag."""
    real = runner.send

    async def late(*args, **kwargs) -> RequestRecord:
        if args[4] == 1:  # request 1 leaves 0.3 s after its arrival
            await asyncio.sleep(0.3)
        return await real(*args, **kwargs)

    monkeypatch.setattr(runner, "send", late)
    fixed = workloads.LengthDist.parse("2")
    specs = workloads.synthetic(0, 3, 50.0, 1.0, fixed, fixed)
    async with completions_server() as url:
        records = await runner.run(specs, runner.BenchConfig(url=url, progress=False))
    s = summarize(records)
    assert all(r.ok for r in records) and 300 <= s["send_lag_ms_max"] < 600
    assert s["send_lag_ms_p50"] < 100 and records[1].to_json()["send_lag_ms"] >= 300
    assert "send_lag_ms_max" not in summarize([RequestRecord(0, 0.0)])  # closed loop: none


async def test_a_resume_refused_to_the_end_keeps_the_last_status():
    async with _resuming_gateway(busy=9) as (live, _), aiohttp.ClientSession() as session:
        with pytest.raises(StreamLost) as lost:
            async for _ in resumable_chunks(session, [live], "/v1/completions", {}, 10.0, 2):
                pass
    assert lost.value.status == 409


async def test_a_cr_only_stream_s_last_event_is_read():
    """Its last line's \\r was held for a \\n that no read brings: [DONE] was never seen,
    and every such stream counted as dropped (resumable) or unfinished (plain)."""
    body = b'data: {"choices": [{"text": "a"}]}\r\rdata: [DONE]\r\r'
    assert await _events([body]) == [(None, b'{"choices": [{"text": "a"}]}'), (None, b"[DONE]")]
    assert (await _send(body)).ok


async def test_a_resume_at_a_gateway_older_than_the_end_s_ids_asks_again_by_the_count():
    """A client with `N.finish` resuming at a gateway that takes digits only (a rolling
    upgrade): its 400 ended the stream; asked again by N, it sends the end again."""
    asked: list[str] = []

    async def resume(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers["Last-Event-ID"])
        if not request.headers["Last-Event-ID"].isdigit():
            return web.Response(status=400)
        return await _sse(b"data: [DONE]\n\n")(request)

    app = web.Application()
    finish = b'data: {"id": "cmpl-x", "choices": [{"text": "", "finish_reason": "stop"}]}\n\n'
    app.router.add_post("/v1/completions", _sse(b"id: 1\n" + _chunk("a") + b"id: 1.finish\n"
                                                 + finish))  # fmt: skip
    app.router.add_get("/v1/streams/{rid}", resume)
    server = TestServer(app)
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as session:
            chunks = [c async for c in resumable_chunks(session, [url], "/v1/completions", {},
                                                        10.0, attempts=3)]  # fmt: skip
    finally:
        await server.close()
    assert [c["choices"][0]["text"] for c in chunks] == ["a", ""]
    assert asked == ["1.finish", "1"]
