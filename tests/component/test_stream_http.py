"""A resumable stream over HTTP, through the gateway's own handlers, a prefill and a decode
node: its client leaves mid-stream and resumes it from its last event. The resumed response
answers with the original request's x-request-id (its client's, else the stream's own id, as
the first response did), and the stream keeps its `stream_options.continuous_usage_stats`
(vLLM's: the usage so far on every chunk), counting on where the client left; an error event
mid-stream carries no `id:`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdserve.common.config import EngineConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.app import completions, resume_stream
from pdserve.gateway.core import Gateway
from pdserve.gateway.requests import Failed
from pdserve.loadgen.resumable import sse_events
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, http_front, until

FAST = EngineConfig(engine="sim", sim_time_scale=0.05, num_kv_blocks=1024)
# decode steps of ~0.3 s: a stream still running when its client, however slow, leaves it
SLOW = dataclasses.replace(FAST, sim_time_scale=30.0)
TOKENS = 48
BODY = {"prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip


async def _nodes(c: Cluster) -> tuple[Any, SimEngine]:
    """A prefill node and a slow decode node: the decode node and its engine (sped up with
    `engine.cfg = FAST`)."""
    await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
    engine = SimEngine(SLOW)
    return await c.add(c.node(DecodeRole, "decode-0", engine=engine, orphan_grace=60.0)), engine


def _http(gw: Gateway) -> contextlib.AbstractAsyncContextManager[str]:
    return http_front(gw, [web.post("/v1/completions", completions),
                           web.get("/v1/streams/{stream_id}", resume_stream)])  # fmt: skip


def _checked(event_id: str | None, chunk: dict) -> None:
    """A chunk's usage so far: the output tokens its id counts."""
    use = chunk["usage"]
    assert event_id is not None and use["completion_tokens"] == int(event_id.split(".")[0])
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]


@pytest.mark.parametrize("header", ["trace-7", None])
async def test_a_resumed_stream_answers_with_its_request_id_and_keeps_continuous_usage(
    tokenizer, header
):
    async with Cluster(tokenizer) as c, _http(c.gw) as url, aiohttp.ClientSession() as s:
        d, engine = await _nodes(c)
        headers = {"pdserve-resumable": "1", **({"x-request-id": header} if header else {})}
        resp = await s.post(f"{url}/v1/completions", json=BODY, headers=headers)
        first_id = resp.headers["x-request-id"]
        seen = []
        async for event_id, payload in sse_events(resp.content):
            chunk = orjson.loads(payload)
            _checked(event_id, chunk)
            seen.append(event_id)
            if len(seen) == 3:
                break
        resp.close()  # the client leaves mid-stream: its stream is kept on its node
        stream_id, have = chunk["id"], seen[-1]
        rid = stream_id.removeprefix("cmpl-")
        assert first_id == (header or rid) and int(have) < TOKENS
        await until(lambda: any(d.control.gateways.owners.orphan(w) for w in d.requests),
                    what="an orphan")  # fmt: skip
        engine.cfg = FAST  # the rest at once
        async with s.get(f"{url}/v1/streams/{stream_id}", headers={"Last-Event-ID": have,
                         "x-request-id": "the-resume's-own"}) as again:  # fmt: skip
            assert again.status == 200, await again.text()
            assert again.headers["x-request-id"] == first_id
            events = [(i, p) async for i, p in sse_events(again.content)]
    assert events[-1] == (None, b"[DONE]")
    chunks = [(i, orjson.loads(p)) for i, p in events[:-1]]
    for event_id, chunk in chunks:
        _checked(event_id, chunk)
    assert int(chunks[0][0]) > int(have)  # nothing the client had sent again
    assert chunks[-1][0] == f"{TOKENS}.usage" and chunks[-1][1]["choices"] == []


async def test_an_error_event_mid_stream_has_no_id(tokenizer):
    """The client's last id is then its last chunk's: the error is no position to resume at."""
    async with Cluster(tokenizer) as c, _http(c.gw) as url, aiohttp.ClientSession() as s:
        await _nodes(c)
        body = {**BODY, "stream_options": {"include_usage": False}}
        resp = await s.post(f"{url}/v1/completions", json=body, headers={"pdserve-resumable": "1"})
        events = []
        async for event_id, payload in sse_events(resp.content):
            events.append((event_id, payload))
            if len(events) == 2:  # failed midway, as after losing its node too often
                [attempt] = list(c.gw.table)
                attempt.req.finish(Failed(503, "request lost its node 3 times"))
        resp.close()
    *text, (error_id, error), done = events
    assert done == (None, b"[DONE]") and error_id is None
    assert orjson.loads(error)["error"]["message"] == "request lost its node 3 times"
    assert len(text) >= 2 and all(i is not None and i.isdigit() for i, _ in text)


async def test_a_request_id_that_is_no_utf8_is_answered_replaced_not_a_500(tokenizer):
    """x-request-id bytes that are no UTF-8: its stream's format (kept on its nodes for a
    resume) cannot carry them as they came; replaced (U+FFFD), the request is served and
    answered with that id, not failed with a 500 while being placed."""
    async with Cluster(tokenizer) as c, _http(c.gw) as url:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=FAST))
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = orjson.dumps({"prompt": "Once", "max_tokens": 2})
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nx-request-id: tr\xffce\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 10.0)
        writer.close()
    head = answer.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head[0].startswith(b"http/1.1 200"), answer[:300]
    assert "x-request-id: tr\ufffdce".encode() in head
