"""A request ended by one of its `stop_token_ids` does not output that token's text, at the
cluster's gateway and in the single-process engine alike (vLLM drops it unless asked to
include it): before, "." as a stop token ended the text with "."."""

from __future__ import annotations

from pdserve.common.engine.llm_engine import _OutputProcessor
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling import SamplingParams
from pdserve.gateway.requests import Delta, Done, GatewayRequest


def _texts(tokenizer, ids: list[int], params: SamplingParams) -> tuple[str, str]:
    """The text the gateway streams and the single-process engine returns for `ids`, the
    last one ending the request with "stop"."""
    req = GatewayRequest(request_id="r", kind="completion", model="m", prompt_ids=[1, 2],
                         params=params, stream=True, include_usage=False,
                         tokenizer=tokenizer)  # fmt: skip
    proc = _OutputProcessor(tokenizer, Sequence.new("r", [1, 2], params))
    for i, token in enumerate(ids):
        reason = "stop" if i == len(ids) - 1 else None
        req.add_token(i, token, reason)
        out = proc.add(token, reason)
    parts = []
    while not req.events.empty():
        event = req.events.get_nowait()
        if isinstance(event, Delta):
            parts.append(event.text)
        else:
            assert event == Done("stop")
    assert out.finished and out.finish_reason == "stop"
    return "".join(parts), out.text


def test_a_stop_token_s_text_is_not_output(tokenizer):
    ids = tokenizer.encode("The sky is blue. It is", False)
    dot = tokenizer.encode(".", False)[0]
    upto = ids.index(dot) + 1
    params = SamplingParams(max_tokens=50, stop_token_ids=(dot,))
    want = tokenizer.decode(ids[: upto - 1])
    assert want == "The sky is blue"
    assert _texts(tokenizer, ids[:upto], params) == (want, want)
    # a token that ends the request by "stop" but is no stop token (EOS): its text as before
    eos = SamplingParams(max_tokens=50)
    assert _texts(tokenizer, ids[:upto], eos) == (want + ".", want + ".")
