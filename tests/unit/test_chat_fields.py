"""vLLM's request fields as a vLLM user sends them (gateway/openai_api.py): the chat
template's own variables (`chat_template_kwargs`), `add_generation_prompt`,
`continue_final_message`, the template environment transformers gives templates
(`{% break %}`, `strftime_now`), whole-number floats for integer fields, and clear 400s
for what is not implemented or cannot fit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve.gateway.openai_api import ApiError, parse_request

TEMPLATE = (
    "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
    "[{{ m.role }}:{{ m.content }}]{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
    "{{ strftime_now('%Y')[:0] }}{% if add_generation_prompt %}[assistant:{% endif %}"
)
USER = {"role": "user", "content": "hi"}


@pytest.fixture
def templated(tokenizer):
    return dataclasses.replace(tokenizer, chat_template=TEMPLATE)


def _chat_text(tok, messages: list[dict[str, Any]], **fields: Any) -> str:
    body = {"messages": messages, "max_tokens": 2, **fields}
    parsed = parse_request("chat", body, tok, "m", 4096)
    return tok.decode(parsed.prompt_ids)


def _refusal(tok, kind: str, body: dict[str, Any], max_model_len: int = 4096) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_request(kind, body, tok, "m", max_model_len)  # type: ignore[arg-type]
    assert err.value.status == 400
    return err.value


def test_template_variables_and_the_generation_prompt_reach_the_template(templated):
    four = [USER, {"role": "assistant", "content": "a"}, USER, USER]
    assert _chat_text(templated, four) == "[user:hi][assistant:a][user:hi][assistant:"
    thinking_off = {"enable_thinking": False, "messages": "not these", "bos_token": "x"}
    text = _chat_text(templated, [USER], chat_template_kwargs=thinking_off)
    assert text == "[user:hi]<nothink>[assistant:"  # the request's own messages win
    assert _chat_text(templated, [USER], add_generation_prompt=False) == "[user:hi]"


def test_a_final_assistant_message_is_continued_when_asked(templated):
    chat = [USER, {"role": "assistant", "content": "Once upon"}]
    text = _chat_text(templated, chat, continue_final_message=True, add_generation_prompt=False)
    assert text == "[user:hi][assistant:Once upon"
    with_prompt = {"messages": chat, "continue_final_message": True}  # vLLM: not both
    assert _refusal(templated, "chat", with_prompt).param == "continue_final_message"
    last_user = {"messages": [USER], "continue_final_message": True,
                 "add_generation_prompt": False}  # fmt: skip
    assert _refusal(templated, "chat", last_user).param == "continue_final_message"


def test_whole_number_floats_are_integers_and_other_floats_a_400(tokenizer):
    body = {"prompt": "hi", "max_tokens": 3.0, "seed": 7.0, "top_k": 5.0, "n": 1.0}
    parsed = parse_request("completion", body, tokenizer, "m", 4096)
    assert (parsed.params.max_tokens, parsed.params.seed, parsed.params.top_k) == (3, 7, 5)
    assert _refusal(tokenizer, "completion", {"prompt": "hi", "max_tokens": 3.5}).param == (
        "max_tokens"
    )
    assert _refusal(tokenizer, "completion", {"prompt": "hi", "seed": 1e308}).param == "seed"


def test_stream_options_need_a_stream(tokenizer):
    body = {"prompt": "hi", "stream_options": {"include_usage": True}}
    assert _refusal(tokenizer, "completion", body).param == "stream_options"
    parsed = parse_request("completion", {**body, "stream": True}, tokenizer, "m", 4096)
    assert parsed.include_usage


@pytest.mark.parametrize(
    ("field", "value"),
    [("include_stop_str_in_output", True), ("skip_special_tokens", False),
     ("bad_words", ["x"]), ("allowed_token_ids", [1]), ("truncate_prompt_tokens", 8)],
)  # fmt: skip
def test_vllm_fields_that_change_the_text_are_a_400_unless_they_ask_for_nothing(
    tokenizer, field, value
):
    err = _refusal(tokenizer, "completion", {"prompt": "hi", field: value})
    assert err.param == field and err.code == "unsupported_parameter"
    nothing = {"include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": []}
    parse_request("completion", {"prompt": "hi", **nothing}, tokenizer, "m", 4096)


def test_a_prompt_that_fills_the_context_is_named_not_max_tokens(tokenizer):
    long_chat = {"messages": [{"role": "user", "content": "hello " * 200}]}
    err = _refusal(tokenizer, "chat", long_chat, max_model_len=64)
    assert err.param == "messages" and err.code == "context_length_exceeded"
    err = _refusal(tokenizer, "completion", {"prompt": list(range(64))}, max_model_len=64)
    assert err.param == "prompt" and err.code == "context_length_exceeded"


def test_more_messages_than_the_context_holds_are_refused_before_rendering(templated):
    many = {"messages": [USER] * 65}
    err = _refusal(templated, "chat", many, max_model_len=64)
    assert err.param == "messages" and "65 messages" in err.message


TRIM = "{% for m in messages %}[{{ m.role }}:{{ m.content | trim }}]{% endfor %}"


def test_a_final_message_trimmed_by_the_template_is_still_continued(tokenizer):
    """Llama 3's template trims every message: the final one is found stripped, and cut
    after its trailing space only where the template kept it (as transformers does)."""
    chat = [USER, {"role": "assistant", "content": "The answer is "}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    trims = dataclasses.replace(tokenizer, chat_template=TRIM)
    assert _chat_text(trims, chat, **fields) == "[user:hi][assistant:The answer is"
    keeps = dataclasses.replace(tokenizer, chat_template=TRIM.replace(" | trim", ""))
    assert _chat_text(keeps, chat, **fields) == "[user:hi][assistant:The answer is "


def test_add_special_tokens_is_honoured_with_vllms_defaults(tokenizer):
    bos_tok = dataclasses.replace(tokenizer, add_bos_token=True, chat_template=TEMPLATE)
    bos = bos_tok.bos_token_id

    def first(kind: str, **fields: Any) -> int:
        body = {"prompt": "hi"} if kind == "completion" else {"messages": [USER]}
        return parse_request(kind, {**body, **fields}, bos_tok, "m", 4096).prompt_ids[0]  # type: ignore[arg-type]

    assert first("completion") == bos and first("chat") != bos  # vLLM's defaults
    assert first("completion", add_special_tokens=False) != bos
    assert first("chat", add_special_tokens=True) == bos


def test_null_tooling_template_variables_ask_for_nothing(templated):
    nothing = {"tools": None, "documents": None}
    assert _chat_text(templated, [USER], chat_template_kwargs=nothing) == "[user:hi][assistant:"
    err = _refusal(templated, "chat", {"messages": [USER], "chat_template_kwargs": {"tools": []}})
    assert err.param == "chat_template_kwargs"


def test_a_context_overflow_names_the_field_the_client_sent(tokenizer):
    for field in ("max_completion_tokens", "max_tokens"):
        err = _refusal(tokenizer, "completion", {"prompt": "hi", field: 64}, max_model_len=64)
        assert err.param == field and err.code == "context_length_exceeded"


def test_an_unknown_model_is_an_invalid_request_as_openai_answers(tokenizer):
    with pytest.raises(ApiError) as err:
        parse_request("completion", {"prompt": "hi", "model": "gpt-17"}, tokenizer, "m", 4096)
    body = err.value.body()["error"]
    assert (err.value.status, body["type"], body["code"]) == (
        404,
        "invalid_request_error",
        "model_not_found",
    )
