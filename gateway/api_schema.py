"""The gateway's HTTP contract as msgspec structs: the request bodies it decodes (the first
step of validation in gateway/openai_api.py, so the published schema and the check are one
definition) and the response shapes it sends (tests decode real responses into them).
gateway/openapi.py turns them into `/openapi.json`.

Sampling fields are not listed here: every `SamplingParams` field (common/sampling.py) is a
request field of the same name, type and range, optional, so a new sampling field reaches
the API and its schema by itself. Unknown fields are ignored, as OpenAI's clients send many,
but not the known ones this server does not implement (`UNSUPPORTED`): a request that asks for
log probabilities, penalties or tools gets a 400 naming the field, not text made without them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pdserve.common.sampling import MAX_STOPS, SamplingParams, StopString

StopList = Annotated[list[StopString], Meta(max_length=MAX_STOPS)]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[TextPart] | None = None  # None only for an assistant turn
    tool_calls: list[Any] | None = None  # refused unless empty: no tools here


# OpenAI's and vLLM's request fields that pdserve does not implement, with the values that ask
# for nothing (also accepted: null). Any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),  # completions: a count, and 0 asks for the chosen token's
    "top_logprobs": (0,),
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    # vLLM's: each changes the text or the prompt; what asks for nothing is accepted
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": (),
    "truncate_prompt_tokens": (),
    "chat_template": (),
    "documents": (),
    "return_tokens_as_token_ids": (False,),
}


class StreamOptions(msgspec.Struct):
    """Other fields ignored, as vLLM's (pydantic, extra="allow"); null as left out.
    `{}` has no usage chunk, as OpenAI's (vLLM's include_usage defaults to true)."""

    include_usage: bool | None = None
    # vLLM's: the usage so far on every chunk (with include_usage, which it defaults to)
    continuous_usage_stats: bool | None = None


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats). include_usage left out is OpenAI's false,
    but true where continuous_usage_stats asks for usage: vLLM defaults it to true, and
    sends usage on every chunk only with it (continuous_usage_stats alone works there)."""
    if options is None:
        return False, False
    continuous = bool(options.continuous_usage_stats)
    include = continuous if options.include_usage is None else options.include_usage
    return include, include and continuous


# `prompt`: checked by code (gateway/openai_api.py `_completion_prompt`), as msgspec cannot
# express "a string, token ids, or a batch of one of either" as one type
PROMPT_SCHEMA = {
    "description": "a string or token ids; a list of one of either (a batch of one)",
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]
            },
        },
    ],
}


def _sampling_fields() -> list[tuple[str, Any, Any]]:
    """Every SamplingParams field but max_tokens (common to both kinds), optional; `stop`
    also as one string, as OpenAI's API takes it."""
    out: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(SamplingParams):
        if f.name == "max_tokens":
            continue
        kind = StopString | StopList if f.name == "stop" else f.type
        out.append((f.name, kind | None, None))
    return out


_COMMON: list[tuple[str, Any, Any]] = [
    ("model", str | None, None),
    ("max_tokens", Annotated[int, Meta(ge=1)] | None, None),
    ("max_completion_tokens", Annotated[int, Meta(ge=1)] | None, None),
    ("n", Literal[1] | None, None),
    ("stream", bool | None, None),
    ("stream_options", StreamOptions | None, None),
    ("return_token_ids", bool | None, None),
    # vLLM's: the tokenizer's BOS added to the prompt; default on for completions, off for
    # chat (its template writes its own)
    ("add_special_tokens", bool | None, None),
    *_sampling_fields(),
]

CompletionRequest = msgspec.defstruct(
    "CompletionRequest",
    [("prompt", Annotated[Any, Meta(extra_json_schema=PROMPT_SCHEMA)]), *_COMMON],
    kw_only=True,
)
ChatCompletionRequest = msgspec.defstruct(
    "ChatCompletionRequest",
    [
        ("messages", Annotated[list[ChatMessage], Meta(min_length=1)]),
        *_COMMON,
        # vLLM's chat fields: variables for the chat template (`enable_thinking`, say), the
        # assistant's opening, or the last assistant message continued instead of answered
        ("chat_template_kwargs", dict[str, Any] | None, None),
        ("add_generation_prompt", bool | None, None),
        ("continue_final_message", bool | None, None),
    ],
    kw_only=True,
)


# -- responses -----------------------------------------------------------------------------
class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx/5xx body, and the last event of a stream that failed midway."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # return_token_ids (vLLM's fields)
    prompt_token_ids: list[int] | None = None


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChunkDelta(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: FinishReason
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


Timings = dict[str, float]  # the server's own phases in ms (ttft, prefill, kv transfer, ...)


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One `data:` event of a chat stream (a completion stream's events are `Completion`s);
    the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok", "unavailable"]
    nodes: dict[str, str]  # node id -> role
    reason: str | None = None
