"""The request fields whose size bounds the gateway's and the nodes' work per token (stop
strings and ids), checked where a body is parsed (gateway/openai_api.py), and on the wire."""

import msgspec
import pytest

from pdserve.common.sampling import MAX_STOP_CHARS, MAX_STOPS, InvalidSampling, SamplingParams
from pdserve.gateway.openai_api import ApiError, parse_request


def _parse(tokenizer, **fields):
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    return parse_request("completion", body, tokenizer, "m", 4096)


@pytest.mark.parametrize(
    "stop",
    [
        "x" * (MAX_STOP_CHARS + 1),  # one string over
        ["x" * 3000, "y" * (MAX_STOP_CHARS - 2999)],  # together over
        [f"s{i}" for i in range(MAX_STOPS + 1)],  # too many
    ],
    ids=["one-long", "together-long", "many"],
)
def test_stop_strings_past_their_bounds_are_a_400_naming_stop(tokenizer, stop):
    with pytest.raises(ApiError) as err:
        _parse(tokenizer, stop=stop)
    assert err.value.status == 400 and err.value.param == "stop"


def test_stop_strings_at_their_bounds_are_accepted(tokenizer):
    stops = ["x" * (MAX_STOP_CHARS - MAX_STOPS + 1)] + ["y"] * (MAX_STOPS - 1)
    assert len(_parse(tokenizer, stop=stops).params.stop) == MAX_STOPS
    ids = list(range(MAX_STOPS))
    assert _parse(tokenizer, stop_token_ids=ids).params.stop_token_ids == tuple(ids)


@pytest.mark.parametrize(
    "ids", [[-1], [49152], list(range(MAX_STOPS + 1)), [2**64]], ids=["neg", "vocab", "many", "big"]
)
def test_stop_token_ids_outside_the_vocabulary_or_too_many_are_a_400(tokenizer, ids):
    assert tokenizer.vocab_size == 49152
    with pytest.raises(ApiError) as err:
        _parse(tokenizer, stop_token_ids=ids)
    assert err.value.status == 400 and err.value.param == "stop_token_ids"


def test_a_node_refuses_oversized_stops_in_a_frame_and_in_code():
    """A peer's frame is decoded against the same bounds; code that builds one too."""
    with pytest.raises(InvalidSampling) as err:
        SamplingParams(stop=("x",) * (MAX_STOPS + 1))
    assert err.value.field == "stop"
    with pytest.raises(InvalidSampling):
        SamplingParams(stop=("x" * 4000, "y" * 200))
    raw = msgspec.msgpack.encode({"stop_token_ids": [1] * (MAX_STOPS + 1)})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=SamplingParams)


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 0), ("logprobs", True), ("n", 2), ("n", True), ("best_of", 3),
     ("presence_penalty", 0.1), ("repetition_penalty", 1.2), ("logit_bias", {"5": 10}),
     ("min_tokens", 3), ("guided_json", {}), ("suffix", "end"), ("echo", True)],
)  # fmt: skip
def test_fields_this_server_does_not_implement_are_a_400_naming_them(tokenizer, field, value):
    with pytest.raises(ApiError) as err:
        _parse(tokenizer, **{field: value})
    assert (err.value.status, err.value.param, err.value.code) == (
        400, field, "unsupported_parameter")  # fmt: skip


def test_their_do_nothing_values_are_accepted(tokenizer):
    plain = _parse(tokenizer, seed=5)
    nothing = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "presence_penalty": 0,
               "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
               "min_tokens": 0}  # fmt: skip
    same = _parse(tokenizer, seed=5, **nothing)
    assert (same.prompt_ids, same.params) == (plain.prompt_ids, plain.params)
