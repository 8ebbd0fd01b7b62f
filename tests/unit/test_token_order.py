"""The gateway places tokens by index: any arrival order, with duplicates, gives the text of the
tokens in order; a gap holds later tokens back; too many held tokens break the attempt."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.sampling import SamplingParams
from pdserve.gateway.requests import MAX_PENDING, Delta, Done, GatewayRequest, StreamGap

TOKENS = [1000 + 37 * i for i in range(12)]


def _request(tokenizer, max_tokens: int = len(TOKENS)) -> GatewayRequest:
    return GatewayRequest(
        request_id="r",
        kind="completion",
        model="m",
        prompt_ids=[1000, 1001],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        stream=True,
        include_usage=False,
        tokenizer=tokenizer,
    )


def _text(req: GatewayRequest) -> str:
    parts = []
    while not req.events.empty():
        event = req.events.get_nowait()
        if isinstance(event, Delta):
            parts.append(event.text)
    return "".join(parts)


def _in_order_text(tokenizer) -> str:
    req = _request(tokenizer)
    for i, t in enumerate(TOKENS):
        req.add_token(i, t, "length" if i == len(TOKENS) - 1 else None)
    return _text(req)


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(len(TOKENS))), st.lists(st.integers(0, len(TOKENS) - 1)))
def test_any_arrival_order_with_duplicates_gives_the_same_text(tokenizer, order, dupes):
    req = _request(tokenizer)
    done = False
    for i in [*order[:3], *dupes, *order[3:]]:
        done = req.add_token(i, TOKENS[i], "length" if i == len(TOKENS) - 1 else None) or done
    assert done and req.output_ids == TOKENS
    assert _text(req) == _in_order_text(tokenizer)
    assert not req.pending and req.gap_since is None


def test_a_token_ahead_of_a_gap_waits_and_marks_the_gap(tokenizer):
    req = _request(tokenizer)
    assert req.add_token(1, TOKENS[1], None) is False
    assert req.output_ids == [] and req.gap_since is not None and req.events.empty()
    req.add_token(0, TOKENS[0], None)
    assert req.output_ids == TOKENS[:2] and req.gap_since is None


def test_a_second_gap_is_timed_from_when_the_first_filled(tokenizer, monkeypatch):
    """Tokens 2 and 5 wait for 1; 1 comes at t=10 s, so 2 goes out and 5 waits for 3 and 4
    from then on: not from t=0, when --stream-gap-timeout would take the attempt as broken
    at once (re-placed, counted as a loss) though its tokens arrived in time."""
    clock = [0.0]
    monkeypatch.setattr("pdserve.gateway.requests.time.monotonic", lambda: clock[0])
    req = _request(tokenizer)
    req.add_token(0, TOKENS[0], None)
    req.add_token(2, TOKENS[2], None)
    req.add_token(5, TOKENS[5], None)
    assert req.gap_since == 0.0
    clock[0] = 10.0
    req.add_token(1, TOKENS[1], None)
    assert req.output_ids == TOKENS[:3] and list(req.pending) == [5]
    assert req.gap_since == 10.0


def test_the_final_token_arriving_first_does_not_end_the_request(tokenizer):
    req = _request(tokenizer, max_tokens=2)
    assert req.add_token(1, TOKENS[1], "length") is False
    assert not req.finished
    assert req.add_token(0, TOKENS[0], None) is True
    assert req.output_ids == TOKENS[:2]
    events = [req.events.get_nowait() for _ in range(req.events.qsize())]
    assert isinstance(events[-1], Done)


def test_too_many_tokens_behind_a_gap_break_the_attempt(tokenizer):
    req = _request(tokenizer, max_tokens=10_000)
    for i in range(1, MAX_PENDING + 1):
        req.add_token(i, 1000, None)
    with pytest.raises(StreamGap):
        req.add_token(MAX_PENDING + 1, 1000, None)


def test_a_new_attempt_counts_its_indices_from_the_tokens_kept(tokenizer):
    req = _request(tokenizer)
    req.add_token(0, TOKENS[0], None)
    req.add_token(1, TOKENS[1], None)
    req.add_token(3, TOKENS[3], None)  # held back; the attempt is then lost
    prompt, params = req.next_attempt()
    assert prompt == [1000, 1001, *TOKENS[:2]] and params.max_tokens == len(TOKENS) - 2
    assert not req.pending and req.gap_since is None
    req.add_token(1, TOKENS[3], None)  # index 1 of the new attempt is output token 3
    req.add_token(0, TOKENS[2], None)
    assert req.output_ids == TOKENS[:4]


def test_tokens_a_slow_reader_has_not_taken_join_one_delta(tokenizer):
    """A client that reads slowly gets several tokens per chunk: the queue holds one Delta
    with all the text it has not taken, never one per token; what it reads is still every
    token's text in order, ids included."""
    req = _request(tokenizer, max_tokens=len(TOKENS))
    for i, t in enumerate(TOKENS[:5]):
        req.add_token(i, t, None)
    assert req.events.qsize() == 1  # five tokens, one waiting Delta
    first = req.events.get_nowait()
    assert isinstance(first, Delta) and first.token_ids == TOKENS[:5]
    req.add_token(5, TOKENS[5], None)  # the reader took the last one: a new Delta
    for i, t in enumerate(TOKENS[6:], start=6):
        req.add_token(i, t, "length" if i == len(TOKENS) - 1 else None)
    rest = [req.events.get_nowait() for _ in range(req.events.qsize())]
    assert [type(e) for e in rest] == [Delta, Done]
    assert first.token_ids + rest[0].token_ids == TOKENS
    assert first.text + rest[0].text == _in_order_text(tokenizer)
