"""The SSE events of a stream (gateway/stream_chunks.py): with vLLM's
`stream_options.continuous_usage_stats` every chunk carries the usage so far (a resumed
stream counting on from its client's last event), the usage chunk comes last as before; an
error event carries no `id:` (it is no position of the stream); and the stream's options and
its client's x-request-id travel to a resuming gateway in the format bytes nodes keep, read by
gateways older and newer than the one that wrote them."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.gateway.openai_api import ApiError, parse_request
from pdserve.gateway.requests import Failed, GatewayRequest
from pdserve.gateway.stream_chunks import StreamChunks
from pdserve.gateway.stream_state import Position, StreamFormat
from tests.unit.test_resume_answers import _found, _resumed
from tests.unit.test_resume_rounds import ID

PROMPT = [5, 6, 7]


def _request(tokenizer, kind="completion", continuous=True, usage=True) -> GatewayRequest:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    return GatewayRequest(request_id=ID, kind=kind, model="m", prompt_ids=PROMPT, params=params,
                          stream=True, include_usage=usage, continuous_usage=continuous,
                          tokenizer=tokenizer)  # fmt: skip


def _events(raw: list[bytes]) -> list[tuple[str | None, dict]]:
    """(id, data) of each SSE event; each event is written whole (one bytes each)."""
    out = []
    for event in raw:
        assert event.endswith(b"\n\n") and event.count(b"\n\n") == 1
        fields = dict(line.split(": ", 1) for line in event.decode().strip().split("\n"))
        assert set(fields) <= {"id", "data"}
        out.append((fields.get("id"), orjson.loads(fields["data"])))
    return out


def _stream(req: GatewayRequest, words: list[int], chunks: StreamChunks, have: int = 0,
            failed: Failed | None = None) -> list[tuple[str | None, dict]]:  # fmt: skip
    """Its tokens from `have` on, each read as it comes (one chunk a token), then its end."""
    raw = chunks.opening()
    for i, token in enumerate(words[have:], have):
        last = i == len(words) - 1 and failed is None
        req.add_token(i, token, "length" if last else None)
        while not req.events.empty():
            raw += chunks.of(req.events.get_nowait())
    if failed is not None:
        raw += chunks.of(failed)
    return _events(raw)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tokenizer, kind):
    """Every chunk carries `usage`: the prompt's tokens, the output tokens so far (counting
    up by each chunk's tokens, 0 on chat's role chunk), their sum; the finish chunk every
    output token; then the usage chunk (no choices) as without the option."""
    words = tokenizer.encode(" one two three four", add_special_tokens=False)
    req = _request(tokenizer, kind)
    events = _stream(req, words, StreamChunks(req, f"cmpl-{ID}"))
    *chunks, (_, final) = events
    counts = [c["usage"]["completion_tokens"] for _, c in chunks]
    assert counts == ([0] if kind == "chat" else []) + list(range(1, len(words) + 1)) + [4]
    for _, c in chunks:
        assert c["choices"] and c["usage"]["prompt_tokens"] == len(PROMPT)
        assert c["usage"]["total_tokens"] == len(PROMPT) + c["usage"]["completion_tokens"]
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "length"
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}  # fmt: skip


def test_without_continuous_usage_stats_chunks_carry_a_null_usage_as_before(tokenizer):
    words = tokenizer.encode(" one two", add_special_tokens=False)
    req = _request(tokenizer, continuous=False)
    *chunks, (_, final) = _stream(req, words, StreamChunks(req, f"cmpl-{ID}"))
    assert [c["usage"] for _, c in chunks] == [None] * 3
    assert final["usage"]["completion_tokens"] == 2
    req = _request(tokenizer, usage=False, continuous=False)  # nothing asked: no usage at all
    assert all("usage" not in c for _, c in _stream(req, words, StreamChunks(req, "x")))


def test_a_resumed_streams_usage_counts_on_from_its_clients_last_event(tokenizer):
    """Resumed after 2 tokens (`id: 2`), with ids: each chunk's usage counts the tokens
    whose text the client has with it, as its id does; nothing before it is sent again."""
    words = tokenizer.encode(" one two three four", add_special_tokens=False)
    req = _request(tokenizer, "chat")
    req.replay(words[:2], 2, 0, None)
    events = _stream(req, words, StreamChunks(req, f"chatcmpl-{ID}", True, Position(2)), have=2)
    assert [i for i, _ in events] == ["3", "4", "4.finish", "4.usage"]
    for event_id, c in events[:-1]:
        assert c["usage"]["completion_tokens"] == int(event_id.split(".")[0])
    assert events[-1][1]["usage"]["completion_tokens"] == 4


def test_an_error_event_carries_no_id(tokenizer):
    """A stream that fails midway: its error event has no `id:` (it repeated the last
    chunk's, so a client holding it could not tell whether it had the error); the chunks
    before it keep theirs, so the client's Last-Event-ID stays its last chunk's."""
    words = tokenizer.encode(" one two three", add_special_tokens=False)
    req = _request(tokenizer, continuous=False, usage=False)
    failed = Failed(503, "request lost its node 3 times", "server_error")
    events = _stream(req, words, StreamChunks(req, f"cmpl-{ID}", True), failed=failed)
    assert [i for i, _ in events] == ["1", "2", "3", None]
    assert events[-1][1]["error"]["message"] == "request lost its node 3 times"


def test_continuous_usage_stats_parse_as_vllm_takes_them(tokenizer):
    """With include_usage (or without it: vLLM defaults it to true); not with include_usage
    false; null as left out; a non-boolean a 400 naming stream_options; other fields of
    stream_options ignored, as vLLM does."""

    def options(**given) -> tuple[bool, bool]:
        body = {"prompt": "hi", "stream": True, "stream_options": given}
        parsed = parse_request("completion", body, tokenizer, "m", 4096)
        return parsed.include_usage, parsed.continuous_usage

    assert options(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert options(continuous_usage_stats=True) == (True, True)
    assert options(include_usage=False, continuous_usage_stats=True) == (False, False)
    assert options(include_usage=True, continuous_usage_stats=None) == (True, False)
    assert options(include_usage=None) == (False, False)
    assert options(include_usage=True, include_obfuscation=False) == (True, False)
    for bad in ("yes", 1, {}):
        with pytest.raises(ApiError) as err:
            options(include_usage=True, continuous_usage_stats=bad)
        assert err.value.status == 400 and err.value.param == "stream_options"


async def test_continuous_usage_and_the_x_request_id_survive_a_resume(tokenizer):
    """The request's stream format (its nodes keep the bytes) brings back, at the gateway
    that adopts it, continuous usage and its client's x-request-id (the resume answers with
    it); the resumed chunks count on from the client's position."""
    words = tokenizer.encode(" one two three four", add_special_tokens=False)
    first = _request(tokenizer)
    first.x_request_id = "trace-7"
    kept = msgspec.structs.replace(_found(ID, tuple(words)), finish_reason="length",
                                   stream_format=first.stream_format())  # fmt: skip
    req, _, _ = await _resumed(tokenizer, Position(1), kept)
    assert req.continuous_usage and req.include_usage and req.echo_id == "trace-7"
    chunks = StreamChunks(req, f"cmpl-{ID}", True, Position(1))
    events = []
    while not req.events.empty():
        events += _events(chunks.of(req.events.get_nowait()))
    assert events[0][1]["usage"]["completion_tokens"] == 4 and events[0][0] == "4"
    assert events[-1][1]["usage"]["total_tokens"] == len(kept.prompt_ids) + 4
    assert [i for i, _ in events] == ["4", "4.finish", "4.usage"]
    # no header from its client: answered with the stream's own id, as its first response
    bare, _, _ = await _resumed(tokenizer, Position(1), _found(ID, tuple(words)))
    assert bare.echo_id == ID and not bare.continuous_usage


def test_stream_formats_read_across_gateway_versions():
    """An older gateway's bytes (no continuous usage, no x-request-id) read as the defaults;
    a newer one's read by an older gateway, which skips what it does not know."""

    class Older(msgspec.Struct, frozen=True, kw_only=True):  # StreamFormat before them
        created: int = 0
        include_usage: bool = False
        return_token_ids: bool = False

    old = msgspec.msgpack.encode(Older(created=5, include_usage=True))
    assert StreamFormat.decode(old) == StreamFormat(created=5, include_usage=True)
    new = StreamFormat(created=5, continuous_usage=True, x_request_id="trace-7").encode()
    assert msgspec.msgpack.decode(new, type=Older) == Older(created=5)
