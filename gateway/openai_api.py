"""OpenAI request validation and response shapes. Pure: no sockets, no clocks.

Validation raises `ApiError` carrying the HTTP status and OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.sampling import InvalidSampling, SamplingParams
from pdserve.gateway.api_schema import (
    UNSUPPORTED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    usage_options,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # as OpenAI's: an unknown model's code says model_not_found
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "cancelled",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: dict[str, str] | None = None  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats


def _param(exc: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error is about: "... - at `$.messages[0].role`" ->
    messages; "Object missing required field `prompt`" -> prompt."""
    text = str(exc)
    if " - at `$." in text:
        where = text.partition(" - at `$.")[2]
        return where.split("`")[0].split(".")[0].split("[")[0] or None
    if "missing required field `" in text and " - at `" not in text:
        return text.partition("missing required field `")[2].split("`")[0]
    return None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, nothing in UNSUPPORTED.items():
        value = body.get(name)
        # by type too: True == 1 and 0 == False, but `logprobs: 0` asks for something
        if value is not None and not any(type(value) is type(v) and value == v for v in nothing):
            also = f" (leave it out or send {nothing[0]!r})" if nothing else ""
            raise ApiError(400, f"'{name}' is not supported by this server{also}", name,
                           "unsupported_parameter")  # fmt: skip


def _decode(kind: Literal["chat", "completion"], body: Any) -> Any:
    """The body as its request struct (gateway/api_schema.py): types and ranges checked."""
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return msgspec.convert(body, schema)
    except msgspec.ValidationError as exc:
        param = _param(exc)
        message = str(exc).partition(" - at `$")[0]
        if isinstance(exc.__cause__, InvalidSampling):  # a range check in __post_init__
            param, message = exc.__cause__.field, str(exc.__cause__)
        raise ApiError(400, f"'{param}': {message}" if param else message, param) from exc


def _message_text(msg: ChatMessage, i: int) -> dict[str, str]:
    if msg.tool_calls:
        raise ApiError(400, f"messages[{i}].tool_calls: tools are not supported by this server",
                       "messages", "unsupported_parameter")  # fmt: skip
    content = msg.content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...], joined as vLLM does
        content = "\n".join(part.text for part in content)
    if content is None:
        if msg.role != "assistant":
            raise ApiError(
                400, f"messages[{i}].content must be a string or a list of text parts", "messages"
            )
        content = ""
    return {"role": "system" if msg.role == "developer" else msg.role, "content": content}


def parse_request(
    kind: Literal["chat", "completion"],
    body: Any,
    tokenizer: Tokenizer,
    served_model: str,
    max_model_len: int,
    vocab_size: int | None = None,
) -> ParsedRequest:
    """The request, checked as its nodes would take it: token ids below `vocab_size`, the
    model's (None: the tokenizer's), a prompt and its output within `max_model_len`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = _whole_numbers(body)
    _refuse_unsupported(body)
    req = _decode(kind, body)
    model = served_model if req.model is None else req.model
    if model != served_model:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{served_model}'",
            "model",
            "model_not_found",
        )
    if kind == "chat":
        text = _chat_text(req, tokenizer, max_model_len)
        # vLLM's add_special_tokens: off for chat (the template writes its own BOS), on for text
        prompt_ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        special = req.add_special_tokens is not False
        prompt_ids = _completion_prompt(req.prompt, tokenizer, max_model_len, special)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt" if kind == "completion" else "messages")
    # min/max run in C: a generator over a long prompt would hold the GIL the event loop
    # thread needs for as long (this runs on a parser thread)
    vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ApiError(400, f"prompt token ids must be in [0, {vocab}), the model's vocabulary",
                       "prompt" if kind == "completion" else "messages")  # fmt: skip
    if len(prompt_ids) >= max_model_len:  # no room for one token, whatever max_tokens says
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; "
                       f"the prompt has {len(prompt_ids)}: shorten it",
                       "messages" if kind == "chat" else "prompt",
                       "context_length_exceeded")  # fmt: skip
    limit = max_model_len - len(prompt_ids)
    max_tokens = req.max_completion_tokens
    sent_as = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = 16 if kind == "completion" else max(1, limit)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(
            400,
            (
                f"this model's maximum context length is {max_model_len} tokens; "
                f"the request has {len(prompt_ids)} prompt tokens and asks for "
                f"{max_tokens} completion tokens ({len(prompt_ids) + max_tokens} in all)"
            ),
            sent_as,
            "context_length_exceeded",
        )
    params = _sampling(req, max_tokens, vocab)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:  # as OpenAI's API and vLLM answer
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true",
                       "stream_options")  # fmt: skip
    include_usage, continuous = usage_options(req.stream_options)
    return ParsedRequest(kind, model, prompt_ids, params, stream, include_usage,
                         bool(req.return_token_ids), continuous)  # fmt: skip


# integer fields a client may send as a whole float (1000.0), as vLLM's parser takes them;
# up to 2**53, where every float is a whole number: 1e308 stays a float, and a 400
WHOLE_NUMBER_FIELDS = ("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "best_of",
                       "min_tokens", "top_logprobs")  # fmt: skip


def _whole_numbers(body: dict[str, Any]) -> dict[str, Any]:
    whole = {k: int(v) for k in WHOLE_NUMBER_FIELDS
             if type(v := body.get(k)) is float and v.is_integer() and abs(v) <= 2**53}  # fmt: skip
    return {**body, **whole} if whole else body


def _chat_text(req: Any, tokenizer: Tokenizer, max_model_len: int) -> str:
    """The chat's prompt text: the messages through the model's chat template, with the
    request's template variables, and its last assistant message continued if asked."""
    if len(req.messages) > max_model_len:  # a token each at least: refused before rendering
        raise ApiError(400, f"{len(req.messages)} messages cannot fit this model's context "
                       f"of {max_model_len} tokens", "messages",
                       "context_length_exceeded")  # fmt: skip
    chat = [_message_text(m, i) for i, m in enumerate(req.messages)]
    _refuse_surely_too_long(tokenizer, "".join(m["content"] for m in chat), max_model_len,
                            "messages")  # fmt: skip
    variables = req.chat_template_kwargs or {}
    tooling = [k for k in ("documents", "tools") if variables.get(k) is not None]
    # the template would be given what the request's own fields may not ask; null asks for
    # nothing (transformers passes tools=None itself)
    if tooling:
        raise ApiError(400, f"'chat_template_kwargs': {tooling[0]!r} is not supported by this "
                       "server", "chat_template_kwargs", "unsupported_parameter")  # fmt: skip
    generation = req.add_generation_prompt is not False
    final = bool(req.continue_final_message)
    if final and (generation or chat[-1]["role"] != "assistant"):
        raise ApiError(400, "'continue_final_message' continues a last assistant message, "
                       "with 'add_generation_prompt': false", "continue_final_message")  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(chat, generation, req.chat_template_kwargs)
        if final and (last := chat[-1]["content"]):
            text = _cut_after_final(text, last)
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from exc
    _refuse_surely_too_long(tokenizer, text, max_model_len, "messages")
    return text


def _cut_after_final(text: str, last: str) -> str:
    """The rendered chat cut right after the final message, as transformers does: found
    stripped, as a template may trim it (Llama 3's `content | trim`), and cut after its
    trailing space only where the template kept that."""
    if (at := text.rfind(last.strip())) < 0:
        raise ValueError("the chat template rewrites the final message: not continuable")
    kept = last.lstrip()
    end = at + (len(kept) if text[at : at + len(kept)] == kept else len(last.strip()))
    return text[:end]


def _refuse_surely_too_long(tokenizer: Tokenizer, text: str, limit: int, param: str) -> None:
    if tokenizer.surely_longer_than(text, limit):
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt "
            f"({len(text)} characters) is longer than that",
            param,
            "context_length_exceeded",
        )


def _completion_prompt(
    prompt: Any, tokenizer: Tokenizer, max_model_len: int, special: bool = True
) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _refuse_surely_too_long(tokenizer, prompt, max_model_len, "prompt")
        return tokenizer.encode(prompt, add_special_tokens=special)
    if isinstance(prompt, list) and len(prompt) > max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {len(prompt)}",
            "prompt",
            "context_length_exceeded",
        )
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def _sampling(req: Any, max_tokens: int, vocab: int) -> SamplingParams:
    """The body's sampling fields (already type- and range-checked against SamplingParams'
    own declarations by `_decode`) as the struct nodes receive."""
    fields = {
        name: value
        for name in SamplingParams.__struct_fields__
        if name != "max_tokens" and (value := getattr(req, name)) is not None
    }
    stop = fields.get("stop")
    if isinstance(stop, str):  # OpenAI: a string or a list of strings
        stop = [stop]
    if stop is not None:
        fields["stop"] = tuple(s for s in stop if s != "")
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        if any(t >= vocab for t in fields["stop_token_ids"]):
            raise ApiError(400, f"stop_token_ids must be in [0, {vocab}), the model's "
                           "vocabulary", "stop_token_ids")  # fmt: skip
    try:
        params = SamplingParams(**fields, max_tokens=max_tokens)
    except InvalidSampling as exc:  # what one field's type cannot say (stop's total length)
        raise ApiError(400, str(exc), exc.field) from exc
    if params.seed is None and not params.greedy:
        # fixed now so every node of every attempt draws alike
        params = params.with_seed(secrets.randbits(63))
    return params


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk in OpenAI's shape."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    kind: str, rid: str, model: str, created: int, use: dict[str, int]
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def final_response(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    use: dict[str, int],
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }
