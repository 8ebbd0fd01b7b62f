"""Resuming a stream at the gateway (gateway/requests.py `replay`): the tokens the client has
are replayed without their text, the rest streams as if never broken; a position where no
chunk ended is refused."""

from __future__ import annotations

import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.gateway.requests import Delta, Done, GatewayRequest


def _request(tokenizer, prompt, params) -> GatewayRequest:
    return GatewayRequest(request_id="r", kind="completion", model="m", prompt_ids=prompt,
                          params=params, stream=True, include_usage=False,
                          tokenizer=tokenizer)  # fmt: skip


def _drain(req: GatewayRequest) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def test_a_resumed_stream_continues_the_text_exactly_from_every_chunk_boundary(tokenizer):
    prompt = tokenizer.encode("The story so far:")
    outputs = tokenizer.encode(" Once upon a time, in a land of café and crème brûlée, 🦜 sang.")
    params = SamplingParams(max_tokens=len(outputs), temperature=0.0)
    whole = _request(tokenizer, prompt, params)
    sent = {0: ""}  # a chunk's id (tokens covered) -> the text the client has with it
    covered, text = 0, ""
    for i, token in enumerate(outputs):
        whole.add_token(i, token, "length" if i == len(outputs) - 1 else None)
        for event in _drain(whole):  # one chunk per token, as a fast reader gets them
            if isinstance(event, Delta):
                covered += len(event.token_ids)
                text += event.text
                sent[covered] = text
    assert text == tokenizer.decode(outputs) and len(sent) > 5
    for have, before in sent.items():
        for made in range(have, len(outputs) + 1):  # the node had made this many
            resumed = _request(tokenizer, prompt, params)
            resumed.replay(outputs[:made], have, 0, "length" if made == len(outputs) else None)
            for i in range(made, len(outputs)):
                resumed.add_token(i, outputs[i], "length" if i == len(outputs) - 1 else None)
            events = _drain(resumed)
            rest = "".join(e.text for e in events if isinstance(e, Delta))
            assert before + rest == text, (have, made)
            assert isinstance(events[-1], Done)


def test_a_position_inside_held_back_text_is_refused(tokenizer):
    prompt = tokenizer.encode("Say:")
    outputs = tokenizer.encode(" hello world again")
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=(" world again!",))
    req = _request(tokenizer, prompt, params)
    req.replay(outputs[:1], 1, 0, None)  # " hello" went out whole: a chunk ended there
    with pytest.raises(ValueError, match="Last-Event-ID 2"):
        # " world" is held back (it may begin the stop string): no chunk ended after it
        _request(tokenizer, prompt, params).replay(outputs, 2, 0, None)


def test_a_position_past_the_tokens_made_is_refused(tokenizer):
    """The node checks the client's Last-Event-ID against the stream, but an answer can be
    read for a later resume of the same stream asking from elsewhere (the first one left):
    a position past what was made would mute text the client never had."""
    prompt = tokenizer.encode("Say:")
    outputs = tokenizer.encode(" hello world")
    req = _request(tokenizer, prompt, SamplingParams(max_tokens=10, temperature=0.0))
    with pytest.raises(ValueError, match=f"Last-Event-ID {len(outputs) + 1} is not a position"):
        req.replay(outputs, len(outputs) + 1, 0, None)
