"""OpenAI request validation and response shapes. Pure: no sockets, no clocks.

Validation raises `ApiError` carrying the HTTP status and OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pdserve.common.sampling import InvalidSampling, SamplingParams
from pdserve.common.tokenizer import Tokenizer

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "cancelled",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

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


def _get(
    body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' must be {_type_name(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise ApiError(
            400, f"'{name}' must be {_type_name(types)}, got {type(value).__name__}", name
        )
    return value


def _type_name(types: type | tuple[type, ...]) -> str:
    seq = types if isinstance(types, tuple) else (types,)
    return " or ".join(
        {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "a boolean",
            list: "a list",
            dict: "an object",
        }.get(t, t.__name__)
        for t in seq
    )


def _message_text(msg: Any, i: int) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise ApiError(400, f"messages[{i}] must be an object", "messages")
    role = msg.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise ApiError(
            400, f"messages[{i}].role must be system, user, assistant or tool", "messages"
        )
    content = msg.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(400, f"messages[{i}].content parts must be text parts", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ApiError(
            400, f"messages[{i}].content must be a string or a list of text parts", "messages"
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_request(
    kind: Literal["chat", "completion"],
    body: Any,
    tokenizer: Tokenizer,
    served_model: str,
    max_model_len: int,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _get(body, "model", str, served_model)
    if model != served_model:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{served_model}'",
            "model",
            "model_not_found",
        )
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        chat = [_message_text(m, i) for i, m in enumerate(messages)]
        try:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = _completion_prompt(body.get("prompt"), tokenizer)
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt" if kind == "completion" else "messages")
    if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
    limit = max_model_len - len(prompt_ids)
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = 16 if kind == "completion" else max(1, limit)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(
            400,
            (
                f"this model's maximum context length is {max_model_len} tokens; "
                f"the request has {len(prompt_ids)} prompt tokens and asks for "
                f"{max_tokens} completion tokens ({len(prompt_ids) + max_tokens} in all)"
            ),
            "max_tokens",
            "context_length_exceeded",
        )
    params = _sampling(body, max_tokens)
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = bool(options.get("include_usage", False)) if stream else False
    return_ids = _get(body, "return_token_ids", bool, False)
    return ParsedRequest(kind, model, prompt_ids, params, stream, include_usage, return_ids)


def _completion_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def _sampling(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    """Every `SamplingParams` field the body names, by its name and type (the struct is the
    one definition of sampling fields: common/sampling.py); OpenAI's own shapes first."""
    fields = {
        name: body[name]
        for name in SamplingParams.__struct_fields__
        if name != "max_tokens" and body.get(name) is not None
    }
    stop = fields.get("stop")
    if isinstance(stop, str):  # OpenAI: a string or a list of strings
        fields["stop"] = [stop]
    if isinstance(fields.get("stop"), list):
        fields["stop"] = [s for s in fields["stop"] if s != ""]
    try:
        params = msgspec.convert({**fields, "max_tokens": max_tokens}, SamplingParams)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, InvalidSampling):  # a range check (wrapped by msgspec)
            raise ApiError(400, str(exc.__cause__), exc.__cause__.field) from exc
        # a type: "Expected `int`, got `str` - at `$.top_k`"
        message, _, where = str(exc).partition(" - at `$.")
        param = where.split("`")[0].split("[")[0] or None
        raise ApiError(400, f"'{param}': {message}" if param else message, param) from exc
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
