"""`/openapi.json`: the gateway's endpoints, request bodies and error shapes as OpenAPI 3.1,
generated from the structs the gateway decodes requests into and builds responses from
(gateway/api_schema.py), so the published contract cannot drift from the checks.

Besides the schema, code checks what a schema cannot say; the spec lists those rules in each
operation's description: the model must be the one served, the prompt non-empty with token
ids below the model's vocabulary size, and prompt + max_tokens within the context length (400
`context_length_exceeded`).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import orjson

from pdserve.gateway import api_schema as s

REF = "#/components/schemas/{name}"
CHECKS = (
    "Checked beyond the schema: `model`, when given, must be the served model (else 404 "
    "`model_not_found`); the prompt must not be empty and its token ids (and "
    "`stop_token_ids`) must be below the model's vocabulary size (400); prompt tokens + "
    "`max_tokens` must fit the context length (400 `context_length_exceeded`); "
    "`stream_options` only with `stream: true` (400). Unknown fields are ignored. With "
    "`stream: true` the 200 response is `text/event-stream`: `data: {json}` events (chunks, "
    "then a usage chunk if asked, or an error object if the request fails midway; with "
    "vLLM's `stream_options.continuous_usage_stats` every chunk carries the usage so far) "
    "and `data: [DONE]`."
)


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}},
    }


ERRORS = {
    "400": _error("invalid request (OpenAI's error object; `param` names the field)"),
    "401": _error("missing or wrong API key (when the gateway has one)"),
    "404": _error("unknown model"),
    "408": _error("the request body stalled past `--body-timeout`"),
    "413": _error("request body too large"),
    "429": _error("too many requests waiting for a prefill node (`--max-waiting`); `Retry-After`"),
    "503": _error("no capacity or no nodes; `Retry-After` says when to come back"),
}


def _generate(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    ref = {"$ref": REF.format(name=response)}
    return {
        "post": {
            "summary": summary,
            "description": CHECKS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": REF.format(name=request)}}},
            },
            "responses": {
                "200": {
                    "description": "the completion, or its stream of chunks",
                    "content": {
                        "application/json": {"schema": ref},
                        "text/event-stream": {
                            "schema": {"type": "string"},
                            "x-event-schema": {"$ref": REF.format(name=chunk)},
                        },
                    },
                },
                **ERRORS,
            },
            "security": [{}, {"bearer": []}],
        }
    }


def _get(summary: str, schema: str | None, errors: dict[str, Any]) -> dict[str, Any]:
    content = (
        {"application/json": {"schema": {"$ref": REF.format(name=schema)}}}
        if schema
        else {"text/plain": {"schema": {"type": "string"}}}
    )
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": summary, "content": content}, **errors},
        }
    }


def _model() -> dict[str, Any]:
    out = _get("one served model", "Model", {"401": ERRORS["401"], "404": ERRORS["404"]})
    out["get"]["parameters"] = [{"name": "model", "in": "path", "required": True,
                                 "schema": {"type": "string"}}]  # fmt: skip
    return out


RESUME = (
    "The rest of a resumable stream (one asked with the header `pdserve-resumable: 1`, whose "
    "SSE events then carry `id: N`, N the output tokens whose text they bring, and "
    "`N.finish`, `N.usage` for the finish and usage chunks) after its connection or its "
    "gateway was lost: any gateway of the cluster adopts it from the node holding it and "
    'streams on after `Last-Event-ID` (docs/architecture.md, "Several gateways"). The '
    "events are those of the original stream after that one, each with its `id:` (an "
    "error event has none), written with the request's own `return_token_ids` and "
    "`stream_options`, under the original request's `x-request-id`."
)


def _resume() -> dict[str, Any]:
    def header(name: str, description: str, where: str = "header") -> dict[str, Any]:
        return {"name": name, "in": where, "required": False, "description": description,
                "schema": {"type": "string"}}  # fmt: skip

    return {
        "get": {
            "summary": "resume a stream",
            "description": RESUME,
            "parameters": [
                {
                    "name": "stream_id",
                    "in": "path",
                    "required": True,
                    "description": "the chunks' `id` (cmpl-... or chatcmpl-...)",
                    "schema": {"type": "string"},
                },
                header("Last-Event-ID", "the `id:` of the last event received (default 0)"),
                header("last_event_id", "the same, as a query parameter", "query"),
                header(
                    "include_usage",
                    "true: a usage chunk before [DONE], even if the request did not ask for one",
                    "query",
                ),
            ],
            "responses": {
                "200": {
                    "description": "the rest of the stream",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "400": _error(
                    "`Last-Event-ID` is not N, N.finish or N.usage (N from 0 to 999999999)"
                ),
                "401": ERRORS["401"],
                "404": _error(
                    "no node holds this stream (unknown, or ended or left longer ago "
                    "than the nodes' `--orphan-grace`)"
                ),
                "409": _error(
                    "`Last-Event-ID` is not an event of this stream, or another "
                    "gateway still serves it (retry)"
                ),
                "429": _error(
                    "this gateway looks for `--max-resuming` streams already; `Retry-After`"
                ),
                "502": _error(
                    "the node holding the stream answered with what no stream can be rebuilt from"
                ),
            },
            "security": [{}, {"bearer": []}],
        }
    }


def spec(model_id: str = "") -> dict[str, Any]:
    structs = [
        s.CompletionRequest,
        s.ChatCompletionRequest,
        s.Completion,
        s.ChatCompletion,
        s.ChatCompletionChunk,
        s.ErrorResponse,
        s.ModelList,
        s.Health,
    ]
    _, components = msgspec.json.schema_components(structs, ref_template=REF)
    unhealthy = {
        "503": {
            "description": "the cluster cannot serve (no prefill or decode node)",
            "content": {"application/json": {"schema": {"$ref": REF.format(name="Health")}}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pdserve gateway",
            "version": "0.1.0",
            "description": "OpenAI-compatible API of a disaggregated prefill/decode cluster"
            + (f", serving {model_id}" if model_id else ""),
        },
        "paths": {
            "/v1/completions": _generate(
                "text completion", "CompletionRequest", "Completion", "Completion"
            ),
            "/v1/chat/completions": _generate(
                "chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            ),
            "/v1/streams/{stream_id}": _resume(),
            "/v1/models": _get("the served model", "ModelList", {"401": ERRORS["401"]}),
            "/v1/models/{model}": _model(),
            "/health": _get("cluster health", "Health", unhealthy),
            "/metrics": _get("Prometheus metrics", None, {}),
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "responses": {
                        "200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}
                    },
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


@functools.lru_cache(maxsize=8)
def spec_json(model_id: str = "") -> bytes:
    """The document as served, built once per model id: it changes with nothing else, and a
    build (msgspec's schema pass, then the encoding) is milliseconds of the gateway's loop."""
    return orjson.dumps(spec(model_id))
