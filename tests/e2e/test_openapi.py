"""`/openapi.json` describes what the gateway really does: every route it serves, request
bodies it accepts and rejects as the schema says, and responses (plain, streamed, errors,
models, health) that decode into the published shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from pdserve.common.config import GatewayConfig
from pdserve.gateway import api_schema as schema
from pdserve.gateway.app import create_app
from tests.e2e.conftest import Cluster, start_cluster
from tests.e2e.test_api import CHAT, COMPLETIONS, SIM_FLAGS, SIM_MODEL, http, post_json


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(prefill=1, decode=1, engine="sim", node_flags=SIM_FLAGS)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def spec(cluster: Cluster) -> dict[str, Any]:
    status, headers, data = http(cluster, "GET", "/openapi.json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    return json.loads(data)


def test_the_spec_lists_every_route_the_gateway_serves(spec: dict[str, Any]) -> None:
    app = create_app(GatewayConfig())
    served: dict[str, set[str]] = {}
    for route in app.router.routes():
        if route.method != "HEAD":  # aiohttp adds HEAD to every GET
            served.setdefault(route.resource.canonical, set()).add(route.method.lower())
    assert spec["openapi"].startswith("3.1")
    assert {path: set(ops) for path, ops in spec["paths"].items()} == served
    schemas = spec["components"]["schemas"]
    for path, ops in spec["paths"].items():  # every $ref resolves
        for ref in _refs(ops):
            assert ref.rsplit("/", 1)[1] in schemas, (path, ref)
    request = schemas["CompletionRequest"]
    assert request["required"] == ["prompt"]
    temperature = request["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)  # SamplingParams' range
    assert SIM_MODEL in spec["info"]["description"]


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "return_token_ids": True}),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
def test_responses_decode_into_the_published_shapes(
    cluster: Cluster, path: str, body: dict
) -> None:
    plain, stream_chunk = (
        (schema.Completion, schema.Completion)
        if path == COMPLETIONS
        else (schema.ChatCompletion, schema.ChatCompletionChunk)
    )
    status, _, data = post_json(cluster, path, body)
    assert status == 200
    msgspec.json.decode(data, type=plain)
    status, _, data = post_json(
        cluster, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        msgspec.json.decode(event.removeprefix("data: "), type=stream_chunk)
    status, _, data = post_json(cluster, path, {**body, "temperature": 9})
    assert status == 400
    err = msgspec.json.decode(data, type=schema.ErrorResponse).error
    assert err.param == "temperature" and "2.0" in err.message
    msgspec.json.decode(http(cluster, "GET", "/v1/models")[2], type=schema.ModelList)
    msgspec.json.decode(http(cluster, "GET", "/health")[2], type=schema.Health)
