"""End-to-end tests of the gateway's OpenAI-compatible HTTP API against real processes.

Most tests share one module-scoped cluster (gateway + 1 prefill + 1 decode node, sim engine,
fast clock). The gateway of that cluster accepts bodies of at most `MAX_BODY` bytes so the 413
case needs no extra cluster. API keys and health without a decode node need their own gateways.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import Cluster, start_cluster, wait_for

SIM_FLAGS = ("--sim-time-scale", "0.05")
SIM_MODEL = "sim-h100-llama3.1-8b"
SIM_CONTEXT = 131072
MAX_BODY = 2000
MESSAGES = [{"role": "user", "content": "Tell me about disaggregated serving."}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# -- helpers -------------------------------------------------------------------------------
def http(
    cluster: Cluster,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """One raw request: (status, headers with lower-case names, body bytes), errors included."""
    req = urllib.request.Request(
        cluster.url + path, data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def post_json(
    cluster: Cluster,
    path: str,
    body: Any,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    return http(
        cluster,
        "POST",
        path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
        timeout,
    )


def assert_openai_error(payload: Any, param: str | None = None) -> dict[str, Any]:
    """`payload` is OpenAI's error object; returns its inner `error`."""
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not None:
        assert err["param"] == param, err
    return err


def health(cluster: Cluster) -> tuple[int, dict[str, Any]]:
    status, text = cluster.get("/health")
    return status, json.loads(text)


def start_gateway(*flags: str) -> Cluster:
    """A gateway with no nodes (add them with `cluster.add_node`); /health answers 503."""
    port, control, tokens = free_port(), free_port(), free_port()
    cluster = Cluster(url=f"http://127.0.0.1:{port}", control=f"tcp://127.0.0.1:{control}")
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "gateway"]
    cmd += ["--port", str(port), "--control-port", str(control), "--tokens-port", str(tokens)]
    cluster.procs.append(subprocess.Popen([*cmd, *flags]))
    cluster.node_flags = ["--engine", "sim", "--heartbeat-interval", "0.2", *SIM_FLAGS]

    def answers() -> bool:
        assert cluster.procs[0].poll() is None, "the gateway exited"
        return cluster.get("/health")[0] != 0  # 0: not listening yet

    if not wait_for(answers, timeout=60, interval=0.1):
        cluster.stop()
        raise RuntimeError("the gateway did not start listening")
    return cluster


def sse_payloads(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body that must consist of nothing but such events."""
    text = body.decode()
    events = re.findall(r"data: ([^\n]*)\n\n", text)
    assert "".join(f"data: {e}\n\n" for e in events) == text, text
    return events


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(
        prefill=1,
        decode=1,
        engine="sim",
        node_flags=SIM_FLAGS,
        gateway_flags=("--max-body-bytes", str(MAX_BODY)),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=60)


# -- 1. bad input --------------------------------------------------------------------------
def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL_TURN = {"role": "assistant", "content": None, "tool_calls": [CALL]}
BAD_BODIES = [
    pytest.param(CHAT, b'{"messages": [', 400, None, id="invalid-json"),
    pytest.param(CHAT, b"", 400, None, id="empty-body"),
    pytest.param(CHAT, b"[1, 2]", 400, None, id="body-not-object"),
    pytest.param(CHAT, {"model": SIM_MODEL, "max_tokens": 4}, 400, "messages", id="no-messages"),
    pytest.param(CHAT, _chat(messages="hi"), 400, "messages", id="messages-str"),
    pytest.param(CHAT, _chat(messages=[]), 400, "messages", id="messages-empty"),
    pytest.param(CHAT, _chat(messages=["hi"]), 400, "messages", id="message-not-object"),
    pytest.param(
        CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages", id="bad-role"
    ),
    pytest.param(
        CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages", id="content-int"
    ),
    pytest.param(CHAT, _chat(max_tokens="ten"), 400, "max_tokens", id="max-tokens-str"),
    pytest.param(CHAT, _chat(max_tokens=2.5), 400, "max_tokens", id="max-tokens-float"),
    pytest.param(CHAT, _chat(max_tokens=True), 400, "max_tokens", id="max-tokens-bool"),
    pytest.param(CHAT, _chat(max_tokens=0), 400, "max_tokens", id="max-tokens-zero"),
    pytest.param(CHAT, _chat(max_tokens=-3), 400, "max_tokens", id="max-tokens-negative"),
    pytest.param(CHAT, _chat(temperature="hot"), 400, "temperature", id="temperature-str"),
    pytest.param(CHAT, _chat(temperature=2.5), 400, "temperature", id="temperature-range"),
    pytest.param(CHAT, _chat(top_p=0), 400, "top_p", id="top-p-zero"),
    pytest.param(CHAT, _chat(min_p=2), 400, "min_p", id="min-p-range"),
    pytest.param(CHAT, _chat(min_p="x"), 400, "min_p", id="min-p-str"),
    pytest.param(CHAT, _chat(stop=5), 400, "stop", id="stop-int"),
    pytest.param(CHAT, _chat(stop=["a", 1]), 400, "stop", id="stop-list-mixed"),
    pytest.param(CHAT, _chat(stop=[f"s{i}" for i in range(65)]), 400, "stop", id="stops-65"),
    pytest.param(CHAT, _chat(stop_token_ids=[-1]), 400, "stop_token_ids", id="stop-id-negative"),
    # the sim model's vocabulary (Llama 3.1's, 128256), which its nodes said; not the
    # tokenizer's (SmolLM2's 49152): the model's bounds the ids it takes
    pytest.param(CHAT, _chat(stop_token_ids=[128256]), 400, "stop_token_ids", id="stop-id-vocab"),
    pytest.param(COMPLETIONS, {"prompt": [5, 128256]}, 400, "prompt", id="prompt-id-vocab"),
    pytest.param(
        CHAT, _chat(stop_token_ids=list(range(65))), 400, "stop_token_ids", id="stop-ids-65"
    ),
    pytest.param(CHAT, _chat(logprobs=True), 400, "logprobs", id="logprobs"),
    pytest.param(CHAT, _chat(presence_penalty=0.5), 400, "presence_penalty", id="penalty"),
    pytest.param(
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
        id="tools",
    ),
    pytest.param(CHAT, _chat(tool_choice="auto"), 400, "tool_choice", id="tool-choice"),
    pytest.param(
        CHAT, _chat(response_format={"type": "json_object"}), 400, "response_format", id="json-mode"
    ),
    pytest.param(CHAT, _chat(messages=[TOOL_TURN]), 400, "messages", id="tool-calls"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": 0}, 400, "logprobs", id="c-logprobs"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo", id="c-echo"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "best_of": 2}, 400, "best_of", id="c-best-of"),
    pytest.param(CHAT, _chat(stream="yes"), 400, "stream", id="stream-str"),
    pytest.param(CHAT, _chat(seed="x"), 400, "seed", id="seed-str"),
    pytest.param(CHAT, _chat(n=2), 400, "n", id="n-2"),
    pytest.param(CHAT, _chat(model=7), 400, "model", id="model-int"),
    pytest.param(CHAT, _chat(model="gpt-17"), 404, "model", id="unknown-model"),
    pytest.param(COMPLETIONS, {"model": SIM_MODEL}, 400, "prompt", id="no-prompt"),
    pytest.param(COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", id="prompt-batch"),
    pytest.param(COMPLETIONS, {"prompt": ""}, 400, "prompt", id="prompt-empty"),
    pytest.param(COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt", id="prompt-bad-ids"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", id="c-mt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "model": "nope"}, 404, "model", id="c-model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_BODIES)
def test_bad_request_bodies(
    cluster: Cluster, path: str, body: Any, status: int, param: str | None
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, headers, data = http(cluster, "POST", path, raw, {"Content-Type": "application/json"})
    assert got == status, data
    assert headers["content-type"].startswith("application/json")
    err = assert_openai_error(json.loads(data), param)
    expected_type = "invalid_request_error"  # OpenAI: a 404 too, its code says what
    assert err["type"] == expected_type
    if status == 404:
        assert err["code"] == "model_not_found"
        assert "gpt-17" in err["message"] or "nope" in err["message"]


def test_fields_that_ask_for_nothing_are_accepted(cluster: Cluster) -> None:
    """What OpenAI's and LangChain's clients send by default for the fields this server
    refuses (a penalty of 0, one choice, no tools) changes nothing: 200, and the same text."""
    defaults = {"n": 1, "best_of": 1, "logprobs": False, "presence_penalty": 0,
                "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "echo": False, "user": "u", "top_logprobs":
                None}  # fmt: skip
    texts = []
    for body in (_chat(max_tokens=6, seed=3), _chat(max_tokens=6, seed=3, **defaults)):
        status, text = cluster.post(CHAT, body)
        assert status == 200, text
        texts.append(text["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


def test_text_parts_are_joined_by_newlines(cluster: Cluster) -> None:
    """vLLM's rule for a message of several text parts: the same prompt as one string."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    ids = []
    for content in (parts, "Hello\nworld"):
        body = _chat(messages=[{"role": "user", "content": content}], return_token_ids=True)
        status, text = cluster.post(CHAT, body)
        assert status == 200, text
        ids.append(text["choices"][0]["prompt_token_ids"])
    assert ids[0] == ids[1]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_context_length_exceeded(cluster: Cluster, client: openai.OpenAI, path: str) -> None:
    status, text = cluster.get("/v1/models")
    context = json.loads(text)["data"][0]["max_model_len"]
    assert context == SIM_CONTEXT
    body: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": "Hello there"}
    # the prompt's length in tokens, as the gateway counts it
    status, ok = cluster.post(path, {**body, "max_tokens": 1})
    assert status == 200, ok
    prompt_tokens = ok["usage"]["prompt_tokens"]
    ask = context - prompt_tokens + 1  # one token too many
    status, payload = cluster.post(path, {**body, "max_tokens": ask})
    assert status == 400
    err = assert_openai_error(payload, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert str(context) in err["message"]
    assert str(prompt_tokens + ask) in err["message"]
    # the same through the openai client: a BadRequestError with the same details
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=10**6)
    assert info.value.code == "context_length_exceeded"
    assert str(context) in info.value.message


def test_body_too_large(cluster: Cluster) -> None:
    body = _chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 500)}])
    status, _, data = post_json(cluster, CHAT, body)
    assert status == 413
    err = assert_openai_error(json.loads(data))
    assert err["type"] == "invalid_request_error"
    assert "too large" in err["message"]
    # just under the limit is served
    small = _chat(messages=[{"role": "user", "content": "x" * (MAX_BODY - 200)}])
    assert len(json.dumps(small)) < MAX_BODY
    status, _, data = post_json(cluster, CHAT, small)
    assert status == 200, data


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", CHAT, 405),
        ("GET", COMPLETIONS, 405),
        ("PUT", CHAT, 405),
        ("POST", "/v1/models", 405),
        ("DELETE", "/health", 405),
        ("GET", "/v1/embeddings", 404),
        ("POST", "/v1/nowhere", 404),
        ("GET", "/", 404),
    ],
)
def test_bad_routes(cluster: Cluster, method: str, path: str, status: int) -> None:
    body = json.dumps(_chat()).encode() if method in ("POST", "PUT") else None
    got, headers, data = http(cluster, method, path, body, {"Content-Type": "application/json"})
    assert got == status
    assert headers["content-type"].startswith("application/json")
    err = assert_openai_error(json.loads(data))
    assert path in err["message"]
    assert err["type"] == "invalid_request_error"  # as OpenAI answers, a 404 included
    if status == 405:  # RFC 9110: a 405 names the allowed methods
        assert method not in headers.get("allow", "") and headers.get("allow"), headers


# -- 2. the openai client ------------------------------------------------------------------
def test_models_listed(cluster: Cluster, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SIM_MODEL]
    status, text = cluster.get("/v1/models")
    assert status == 200
    body = json.loads(text)
    assert body["object"] == "list"
    assert body["data"][0]["id"] == SIM_MODEL
    assert body["data"][0]["object"] == "model"
    card = client.models.retrieve(SIM_MODEL)  # GET /v1/models/{model}
    assert (card.id, card.object) == (SIM_MODEL, "model")
    status, text = cluster.get("/v1/models/gpt-17")
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 1234}])
def test_openai_chat(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    n = 12
    full = client.chat.completions.create(
        model=SIM_MODEL, messages=MESSAGES, max_tokens=n, **sampling
    )
    assert full.object == "chat.completion"
    assert full.model == SIM_MODEL
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert full.usage is not None
    assert full.usage.completion_tokens == n
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + n

    chunks = list(
        client.chat.completions.create(
            model=SIM_MODEL,
            messages=MESSAGES,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f is not None] == ["length"]
    assert finishes[-1] == "length"  # nothing after the finish but the usage chunk
    # sim tokens are ordinary words: a chunk per step, unless tokens came while the handler
    # was still writing the last chunk, which then travel together (gateway/requests.py)
    assert 1 <= len(content) <= n
    assert "".join(content) == choice.message.content
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == n
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # without include_usage no chunk carries usage
    plain = list(
        client.chat.completions.create(
            model=SIM_MODEL, messages=MESSAGES, max_tokens=n, stream=True, **sampling
        )
    )
    assert all(c.usage is None for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in plain)
    assert text == choice.message.content


def test_openai_completions(client: openai.OpenAI) -> None:
    n = 9
    prompt = "The quick brown fox"
    full = client.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=n, temperature=0)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.choices[0].text
    assert full.usage is not None
    assert full.usage.completion_tokens == n
    assert full.usage.total_tokens == full.usage.prompt_tokens + n

    chunks = list(
        client.completions.create(
            model=SIM_MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    # one token per chunk while the client keeps up; a client read late gets the tokens that
    # came meanwhile in one chunk (gateway/requests.py), as from vLLM: never more chunks
    assert 1 <= len(texts) <= n
    assert "".join(texts) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f is not None] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    # the default budget of a completion is 16 tokens
    default = client.completions.create(model=SIM_MODEL, prompt=prompt, temperature=0)
    assert default.usage is not None and default.usage.completion_tokens == 16
    assert default.choices[0].finish_reason == "length"


def test_openai_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(model=SIM_MODEL, prompt="Once", max_tokens=10, temperature=0)
    text = full.choices[0].text
    cut = text.split()[2]  # a word from the middle of the output
    stopped = client.completions.create(
        model=SIM_MODEL, prompt="Once", max_tokens=10, temperature=0, stop=[cut]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(cut)]
    assert stopped.usage is not None and stopped.usage.completion_tokens < 10


def test_openai_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=0)
    assert bad.value.param == "max_tokens"


# -- 3. raw SSE ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_sse_wire_format(cluster: Cluster, path: str) -> None:
    n = 6
    body: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": "Hello"}
    body |= {"max_tokens": n, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    status, headers, data = post_json(cluster, path, body)
    assert status == 200, data
    assert headers["content-type"].startswith("text/event-stream")
    assert headers.get("cache-control") == "no-cache"
    payloads = sse_payloads(data)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    events = [json.loads(p) for p in payloads[:-1]]
    kind = "chat.completion.chunk" if path == CHAT else "text_completion"
    assert all(e["object"] == kind and "error" not in e for e in events)
    assert events[-1]["usage"]["completion_tokens"] == n
    assert events[-1]["choices"] == []
    # OpenAI's rule with include_usage: every other chunk carries "usage": null
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompt_and_every_output_token(
    cluster: Cluster, stream: bool
) -> None:
    """vLLM's `return_token_ids`: a client (a multi-turn benchmark) continues from the exact
    tokens, not a re-tokenization of the text. A stop string cuts the text, not the ids."""
    prompt = [1000 + i for i in range(20)]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, _, data = post_json(cluster, COMPLETIONS, {**body, "return_token_ids": True})
    assert status == 200, data
    full = json.loads(data)["choices"][0]
    assert full["prompt_token_ids"] == prompt and len(full["token_ids"]) == 8
    cut = full["text"].split()[2]
    body |= {"return_token_ids": True, "stream": stream, "stop": [cut]}
    status, _, data = post_json(cluster, COMPLETIONS, body)
    assert status == 200, data
    if stream:
        chunks = [json.loads(p)["choices"][0] for p in sse_payloads(data)[:-1]]
        assert chunks[0]["prompt_token_ids"] == prompt
        ids = [t for c in chunks for t in c["token_ids"]]
        text = "".join(c["text"] for c in chunks)
    else:
        choice = json.loads(data)["choices"][0]
        ids, text = choice["token_ids"], choice["text"]
    assert text == full["text"][: full["text"].index(cut)]
    assert ids == full["token_ids"][: len(ids)] and len(text) < len(full["text"])
    status, _, data = post_json(cluster, COMPLETIONS, {"prompt": prompt, "return_token_ids": 1})
    assert status == 400 and "return_token_ids" in data.decode()


def test_sse_error_before_stream_is_plain_json(cluster: Cluster) -> None:
    status, headers, data = post_json(cluster, CHAT, _chat(stream=True, temperature="hot"))
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert_openai_error(json.loads(data), "temperature")


# -- 4. health -----------------------------------------------------------------------------
def test_health_ok(cluster: Cluster) -> None:
    status, body = health(cluster)
    assert status == 200
    assert body["status"] == "ok"
    assert body["nodes"] == {"prefill-0": "prefill", "decode-0": "decode"}


def test_health_without_decode_node() -> None:
    gw = start_gateway("--heartbeat-timeout", "1.0")
    try:
        status, body = health(gw)
        assert status == 503
        assert "decode" in body["reason"] and "prefill" in body["reason"]

        gw.add_node("prefill", "prefill-0")
        assert wait_for(lambda: "prefill-0" in health(gw)[1]["nodes"], timeout=60)
        status, body = health(gw)
        assert status == 503
        assert body["status"] == "unavailable"
        assert "decode" in body["reason"] and "prefill" not in body["reason"]
        # generation is refused with a 503 JSON error meanwhile
        status, payload = gw.post(CHAT, _chat())
        assert status == 503
        err = assert_openai_error(payload)
        assert err["code"] == "service_unavailable" and "decode" in err["message"]
        raw = urllib.request.Request(gw.url + CHAT, json.dumps(_chat()).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(raw, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"

        decode = gw.add_node("decode", "decode-0")
        assert wait_for(lambda: health(gw)[0] == 200, timeout=60)
        status, payload = gw.post(CHAT, _chat())
        assert status == 200, payload

        decode.kill()  # no goodbye: the gateway notices by the missing heartbeats
        decode.wait()
        assert wait_for(lambda: health(gw)[0] == 503, timeout=15)
        status, body = health(gw)
        assert "decode" in body["reason"]
        assert body["nodes"] == {"prefill-0": "prefill"}
    finally:
        gw.stop()


# -- 5. metrics ----------------------------------------------------------------------------
def test_metrics(cluster: Cluster, client: openai.OpenAI) -> None:
    status, text = cluster.get("/metrics")
    assert status == 200
    for name in (
        "pdserve:time_to_first_token_seconds",
        "pdserve:inter_token_latency_seconds",
        "pdserve:placement_accepts_total",
        "pdserve:kv_blocks",
    ):
        assert name in text, name
    for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert f'pdserve:kv_blocks{{node="{node}",role="{role}",state="free"}}' in text
        assert wait_for(
            lambda n=node: cluster.metric("pdserve:kv_blocks", node=n, state="free") > 0
        )

    def snapshot() -> dict[str, float]:
        return {
            "ttft": cluster.metric("pdserve:time_to_first_token_seconds_count"),
            "itl": cluster.metric("pdserve:inter_token_latency_seconds_count"),
            "accepts": cluster.metric("pdserve:placement_accepts_total", node="prefill-0"),
            "ok": cluster.metric("pdserve:requests_total", outcome="ok"),
            "gen": cluster.metric("pdserve:generation_tokens_total"),
            "prompt": cluster.metric("pdserve:prompt_tokens_total"),
        }

    before = snapshot()
    n = 7
    out = client.chat.completions.create(
        model=SIM_MODEL, messages=MESSAGES, max_tokens=n, temperature=0
    )
    assert out.usage is not None
    after = snapshot()
    assert after["ttft"] - before["ttft"] == 1
    assert after["itl"] - before["itl"] == n - 1
    assert after["accepts"] - before["accepts"] == 1
    assert after["ok"] - before["ok"] == 1
    assert after["gen"] - before["gen"] == n
    assert after["prompt"] - before["prompt"] == out.usage.prompt_tokens


# -- 6. API key ----------------------------------------------------------------------------
def test_api_key() -> None:
    keyed = start_cluster(
        prefill=1,
        decode=1,
        engine="sim",
        node_flags=SIM_FLAGS,
        gateway_flags=("--api-key", "secret"),
    )
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            status, _, data = post_json(keyed, CHAT, _chat(), headers)
            assert status == 401
            err = assert_openai_error(json.loads(data))
            assert err["type"] == "authentication_error"
            assert err["code"] == "invalid_api_key"
        status, _, data = http(keyed, "GET", "/v1/models")
        assert status == 401
        # a header with bytes beyond ASCII: compare_digest raised on the str (a 500 and a
        # logged traceback for anyone)
        host, port = keyed.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: Bearer \xc3\xa9\r\n\r\n")  # fmt: skip
            assert sock.recv(12).split(b" ")[1] == b"401"
        good = {"Authorization": "Bearer secret"}
        status, _, data = post_json(keyed, CHAT, _chat(), good)
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 4
        status, _, data = http(keyed, "GET", "/v1/models", headers=good)
        assert status == 200
        # health and metrics stay open for probes and scrapers
        assert keyed.get("/health")[0] == 200
        assert keyed.get("/metrics")[0] == 200
        # the openai client: the right key works, a wrong one is an AuthenticationError
        ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key="secret", max_retries=0)
        out = ok.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=3)
    finally:
        keyed.stop()


# -- 7. request ids ------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_request_id_echoed(cluster: Cluster, stream: bool) -> None:
    rid = f"my-trace-{int(stream)}-42"
    status, headers, data = post_json(cluster, CHAT, _chat(stream=stream), {"x-request-id": rid})
    assert status == 200, data
    assert headers.get("x-request-id") == rid


def test_request_id_generated_when_absent(cluster: Cluster) -> None:
    ids = []
    for _ in range(2):
        status, headers, data = post_json(cluster, CHAT, _chat())
        assert status == 200, data
        ids.append(headers.get("x-request-id"))
    assert all(ids) and ids[0] != ids[1]


def test_duplicate_request_ids_are_independent(cluster: Cluster) -> None:
    """Clients reuse x-request-id (retries, one trace id per session): concurrent requests
    sharing one must still be separate requests, each echoed the id it sent."""
    n, results = 40, []

    def one(i: int) -> None:
        body = _chat(max_tokens=n, temperature=0.7, seed=i)
        results.append(post_json(cluster, CHAT, body, {"x-request-id": "shared"}, timeout=20))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3
    texts = set()
    for status, headers, data in results:
        assert status == 200, data
        assert headers.get("x-request-id") == "shared"
        body = json.loads(data)
        assert body["usage"]["completion_tokens"] == n
        texts.add(body["choices"][0]["message"]["content"])
    assert len(texts) == 3  # different seeds: no request got another's tokens


# -- the real model ------------------------------------------------------------------------
TORCH_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def torch_cluster() -> Iterator[Cluster]:
    c = start_cluster(prefill=1, decode=1, engine="torch")
    yield c
    c.stop()


def test_openai_client_with_real_model(torch_cluster: Cluster) -> None:
    """SmolLM2's tokens are not all whole words (held-back text, EOS): streamed text must
    still equal the non-streamed text of the same greedy request, usage must agree."""
    client = openai.OpenAI(base_url=torch_cluster.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [TORCH_MODEL]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    n = 12
    full = client.chat.completions.create(
        model=TORCH_MODEL, messages=messages, max_tokens=n, temperature=0
    )
    assert full.usage is not None and 1 <= full.usage.completion_tokens <= n
    finish = full.choices[0].finish_reason
    assert finish in ("stop", "length")
    assert (finish == "length") == (full.usage.completion_tokens == n)
    chunks = list(
        client.chat.completions.create(
            model=TORCH_MODEL,
            messages=messages,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(content) == full.choices[0].message.content
    assert len(content) <= full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()

    plain = client.completions.create(
        model=TORCH_MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0
    )
    streamed = client.completions.create(
        model=TORCH_MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TORCH_MODEL, messages=messages, max_tokens=8192)
    assert info.value.code == "context_length_exceeded"
    assert "8192" in info.value.message
