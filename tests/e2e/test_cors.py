"""Cross-origin calls from a browser (CORS) against a real gateway: preflights answered
before the API key is checked, allowed origins named on every response (streams and errors
too), others given no CORS header at all."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pdserve.gateway.cors import Cors
from tests.e2e.conftest import Cluster, start_cluster
from tests.e2e.test_api import CHAT, SIM_FLAGS, SIM_MODEL, http, post_json

UI = "https://ui.example"
KEY = {"Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(prefill=1, decode=1, engine="sim", node_flags=SIM_FLAGS,
                      gateway_flags=("--api-key", "secret", "--allowed-origins",
                                     f"{UI}, https://other.example"))  # fmt: skip
    yield c
    c.stop()


def _preflight(cluster: Cluster, origin: str) -> tuple[int, dict[str, str]]:
    asked = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, last-event-id",
    }
    status, headers, _ = http(cluster, "OPTIONS", CHAT, headers=asked)
    return status, headers


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_api_key(cluster):
    status, headers = _preflight(cluster, UI)
    assert status == 204
    assert headers["access-control-allow-origin"] == UI
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type, last-event-id"
    status, headers = _preflight(cluster, "https://evil.example")
    assert status == 204 and "access-control-allow-origin" not in headers  # refused by browsers
    # an OPTIONS that is no preflight is what it was: 405, in OpenAI's error shape
    status, _, data = http(cluster, "OPTIONS", CHAT, headers={**KEY, "Origin": UI})
    assert status == 405 and json.loads(data)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_to_an_allowed_origin_name_it_errors_included(cluster, stream):
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": stream}  # fmt: skip
    status, headers, data = post_json(cluster, CHAT, body, {**KEY, "Origin": UI})
    assert status == 200, data
    assert headers["access-control-allow-origin"] == UI
    assert "x-request-id" in headers["access-control-expose-headers"]
    if stream:
        assert data.rstrip().endswith(b"data: [DONE]")
    status, headers, _ = post_json(cluster, CHAT, body, {"Origin": UI})  # no key
    assert status == 401 and headers["access-control-allow-origin"] == UI  # readable error
    status, headers, _ = post_json(cluster, CHAT, body, {**KEY, "Origin": "https://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_the_origin_rule():
    """`*` (the default, as vLLM's and SGLang's servers) any origin; empty none."""
    assert Cors("*").allows("https://a.example") == "*"
    assert Cors("").allows("https://a.example") is None
    listed = Cors(" https://a.example ,https://B.example/")
    assert listed.allows("https://b.example") == "https://b.example"
    assert listed.allows("https://a.example.evil") is None
