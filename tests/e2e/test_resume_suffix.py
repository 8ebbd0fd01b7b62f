"""A resumed stream is the rest of the stream it resumes, exactly (docs/architecture.md,
"Several gateways"): whichever event a client had last (the chat's role chunk, a text chunk,
the chunk with the finish reason, the usage chunk), the events it had and those the resume
brings are together the uninterrupted stream's: the same ids and fields (token ids, usage,
`created`), nothing lost or repeated; one that had the last event gets the end of the stream
only. A resume needs nothing of the request but its id and `Last-Event-ID`: the request's
output options (`return_token_ids`, `stream_options`) are the stream's, at any gateway.
Real gateway and node processes (sim engine), each resume at the other gateway."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.loadgen.resumable import sse_events
from tests.e2e.conftest import start_cluster
from tests.e2e.streams import sim_text, stopped_half_way

Event = tuple[str | None, dict[str, Any] | None]  # (id, chunk); [DONE] is (None, None)
PROMPT = list(range(1000, 1040))
OPTIONS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True},
           "return_token_ids": True}  # fmt: skip


@pytest.fixture(scope="module", params=[{"prefill": 1, "decode": 1}, {"colocated": 1}],
                ids=["1P1D", "colocated"])  # fmt: skip
def cluster(request):
    """The stream kept by a decode node its prefill node's KV went to, or by the node that
    took the offer (the stream's options reach each from the offer)."""
    # --drain-timeout 1: each stream ended is kept for the grace, which a node stopped at
    # teardown would wait out (past the 10 s it is given): handed back after 1 s instead
    flags = ("--sim-time-scale", "1", "--orphan-grace", "60", "--drain-timeout", "1")
    nodes = {"prefill": 0, "decode": 0, **request.param}
    cluster = start_cluster(engine="sim", gateways=2, node_flags=flags, **nodes)
    yield cluster
    cluster.stop()


def _bodies(tokenizer) -> dict[str, dict[str, Any]]:
    """A chat, a completion, and a completion that ends at a stop string (tokens whose text
    never shows: they come with the finish chunk)."""
    base = {"max_tokens": 12, "seed": 5, "temperature": 1.0, "ignore_eos": True, "stream": True}
    _, stop = stopped_half_way(sim_text(tokenizer, PROMPT, 5, 12))
    return {
        "chat": {**base, "messages": [{"role": "user", "content": "Tell me a story."}]},
        "completion": {**base, "prompt": PROMPT},
        "stop string": {**base, "prompt": PROMPT, "stop": stop},
    }


async def _events(resp: aiohttp.ClientResponse) -> list[Event]:
    assert resp.status == 200, (resp.status, await resp.text())
    out: list[Event] = []
    async for event_id, payload in sse_events(resp.content):
        out.append((None, None) if payload == b"[DONE]" else (event_id, orjson.loads(payload)))
    assert out and out[-1] == (None, None), out[-3:]  # a stream ends with [DONE]
    return out


async def _resume(session, url: str, stream_id: str, last_id: str, query: str) -> list[Event]:
    """The resume from `last_id`; a 409 (its last resume's Release not read by the node
    yet) is asked again, within a deadline."""
    deadline = time.monotonic() + 30
    while True:
        async with session.get(f"{url}/v1/streams/{stream_id}{query}",
                               headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
            if resp.status != 409 or time.monotonic() > deadline:
                return await _events(resp)
        await asyncio.sleep(0.05)


def _text_chunk(chunk: dict[str, Any] | None) -> bool:
    if chunk is None or not chunk["choices"]:
        return False
    choice = chunk["choices"][0]
    return choice["finish_reason"] is None and "role" not in choice.get("delta", {})


def _join(into: dict[str, Any], chunk: dict[str, Any]) -> None:
    """`chunk`'s text and token ids appended to `into`'s, its usage so far (continuous
    usage) taking `into`'s place; every other field the same."""
    a, b = into["choices"][0], chunk["choices"][0]
    assert "prompt_token_ids" not in b, "the prompt's token ids came again"

    def rest(c: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(c)
        choice = out["choices"][0]
        for key in ("text", "token_ids", "prompt_token_ids"):
            choice.pop(key, None)
        choice.get("delta", {}).pop("content", None)
        out.pop("usage", None)
        return out

    assert rest(into) == rest(chunk)
    if "usage" in chunk:
        into["usage"] = chunk["usage"]
    if "delta" in a:
        a["delta"]["content"] += b["delta"]["content"]
    else:
        a["text"] += b["text"]
    if "token_ids" in a or "token_ids" in b:
        a["token_ids"] = a.get("token_ids", []) + b.get("token_ids", [])


def _fold(events: list[Event]) -> list[Event]:
    """The events as what a client has from them: consecutive text chunks as one (where a
    stream's text splits depends on how fast its client reads), with the last one's id;
    the gateway's own timings left out (the serving gateway's view)."""
    out: list[Event] = []
    for event_id, chunk in copy.deepcopy(events):
        if chunk is not None:
            chunk.pop("timings", None)
        if out and _text_chunk(chunk) and _text_chunk(out[-1][1]):
            assert chunk is not None and out[-1][1] is not None
            _join(out[-1][1], chunk)
            out[-1] = (event_id, out[-1][1])
        else:
            out.append((event_id, chunk))
    return out


async def _check_every_resume(
    cluster, cases: list[tuple[dict[str, Any], str, bool]]
) -> list[tuple[int, str]]:
    """Each case's stream (body, query, trailers) read whole at one gateway, then resumed at
    the other from each event it has (`trailers`: the finish and usage chunks too, else the
    rest); `query` is passed to each resume. Returns each stream's number of resumes and
    finish reason."""
    first, other = cluster.urls
    headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}
    async with aiohttp.ClientSession() as session:
        streams = []
        for body, _, _ in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            async with session.post(f"{first}{path}", data=orjson.dumps(body),
                                    headers=headers) as resp:  # fmt: skip
                streams.append(await _events(resp))
        # every resume in a later second than its stream began (a new `created` would show):
        # one wait for all of them, not one each
        created = [next(c for _, c in whole if c is not None)["created"] for whole in streams]
        while int(time.time()) <= max(created):
            await asyncio.sleep(0.05)
        out = []
        for (_, query, trailers), whole in zip(cases, streams, strict=True):
            chunks = [c for _, c in whole if c is not None]
            stream_id = chunks[0]["id"]
            resumes = 0
            for i, (event_id, chunk) in enumerate(whole):
                if event_id is None or not (trailers or _text_chunk(chunk) or i == 0):
                    continue
                rest = await _resume(session, other, stream_id, event_id, query)
                assert _fold(whole[: i + 1] + rest) == _fold(whole), (event_id, rest)
                resumes += 1
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            out.append((resumes, reasons[-1]))
        return out


def test_a_resume_from_any_event_brings_exactly_the_events_after_it(cluster, tokenizer):
    """From each event id, the finish and usage chunks included: nothing repeated (a client
    that had the usage chunk gets only [DONE]), nothing lost. The usage chunk is asked for
    again by the resume's `?include_usage=true`, as a client of an older gateway would."""
    bodies = _bodies(tokenizer)
    usage = {"stream_options": {"include_usage": True}}
    cases = [({**body, **usage}, "?include_usage=true", True) for body in bodies.values()]
    cases.append((bodies["completion"], "", True))  # no usage chunk: the finish chunk is last
    *checked, (plain, _) = asyncio.run(_check_every_resume(cluster, cases))
    for name, (resumes, reason) in zip(bodies, checked, strict=True):
        assert resumes >= 4, name  # the role or a text chunk, the finish and usage chunks
        assert reason == ("stop" if name == "stop string" else "length"), name
    assert plain >= 2


def test_a_resumed_stream_keeps_its_requests_output_options(cluster, tokenizer):
    """`return_token_ids` and `stream_options` (`include_usage`, `continuous_usage_stats`)
    were the request's only (the resume says none): the resumed chunks carry the token ids
    from where the client's left off (the prompt's once, in the stream's first), `usage`
    (each chunk's so far), and the stream's `created`, as the uninterrupted stream's do."""
    bodies = _bodies(tokenizer)
    cases = [({**body, **OPTIONS}, "", False) for body in bodies.values()]
    checked = asyncio.run(_check_every_resume(cluster, cases))
    for name, (resumes, _) in zip(bodies, checked, strict=True):
        assert resumes >= 2, name
