"""The gateway's HTTP side: OpenAI-compatible routes, SSE streaming, health and metrics.

`create_app(config)` builds the aiohttp application; the gateway (gateway/core.py) starts and
stops in its cleanup context, and the handlers talk to its `RequestService` only. Every error
leaves as OpenAI's JSON error object, including aiohttp's own (404, 405, 413). A streaming
handler that finds its client gone aborts the request on every node that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.common.aio import within
from pdserve.common.config import GatewayConfig
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.wire.address import bracket
from pdserve.gateway.core import Gateway
from pdserve.gateway.cors import Cors
from pdserve.gateway.openai_api import ApiError, error_body, final_response, usage
from pdserve.gateway.openapi import spec_json
from pdserve.gateway.requests import Delta, Done, Failed, GatewayRequest
from pdserve.gateway.service import RequestService
from pdserve.gateway.sse import Connection
from pdserve.gateway.stream_chunks import DONE, StreamChunks
from pdserve.gateway.stream_state import Position

log = logging.getLogger(__name__)
timeline_log = logging.getLogger("pdserve.timeline")
SERVICE = web.AppKey("service", RequestService)
# Kernel send buffer of a streaming response. Linux grows it up to 4 MB per connection, so a
# client that reads slowly would park megabytes in the kernel, one chunk per token, before
# the handler felt any back-pressure; at 64 KiB (a few hundred chunks) the handler's write
# waits soon, and the tokens arriving meanwhile join one chunk (gateway/requests.py). Token
# streams need ~20 KB/s: this is far above that even at 100 ms of round trip.
STREAM_SNDBUF = 64 * 1024
CONFIG = web.AppKey("config", GatewayConfig)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def retry_after(failed: Failed) -> dict[str, str] | None:
    """503s and 429s say when to come back: the gateway's estimate, else a second."""
    if failed.status not in (429, 503):
        return None
    return {"Retry-After": str(max(1, math.ceil(failed.retry_after or 1)))}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(err.body(), err.status, headers)


async def count_status(request: web.Request, response: web.StreamResponse) -> None:
    # as its head leaves: refusals too, and a stream its client left (cancelled, no return)
    if SERVICE in request.app:
        request.app[SERVICE].metrics.http_response(response.status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err, err.headers)
    except web.HTTPException as exc:  # aiohttp's 404/405/413 as OpenAI JSON
        if exc.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "request body too large",
        }.get(exc.status, exc.reason)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # 405
        return json_response(error_body(exc.status, message), exc.status, allow)
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise  # a stream already under way: aiohttp closes it (it logs the error)
        log.exception("%s %s failed", request.method, request.path)
        return json_response(error_body(500, "internal error (logged by the gateway)"), 500)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not secrets.compare_digest(given, f"Bearer {key}".encode()):  # bytes: any header
            raise ApiError(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                code="invalid_api_key",
            )
    return await handler(request)


async def read_body(request: web.Request) -> bytes:
    """The whole body, each read within --body-timeout (an idle bound, not a total one: a
    slow upload that keeps moving is read; a stalled one is a 408, then aiohttp's lingering
    close), and 413 past --max-body-bytes as `request.read()` would."""
    cfg = request.app[CONFIG]
    body = bytearray()
    while True:
        try:
            chunk = await within(request.content.readany(), cfg.body_timeout)
        except asyncio.TimeoutError:
            stalled = f"the request body stalled for {cfg.body_timeout:g} s"
            raise ApiError(408, stalled, code="timeout") from None
        except (web.RequestPayloadError, HttpProcessingError) as exc:  # a Content-Encoding lie
            raise ApiError(400, f"malformed request body: {exc}") from None
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > cfg.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=cfg.max_body_bytes, actual_size=len(body))


async def read_json(request: web.Request) -> Any:
    raw = await read_body(request)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(
    request: web.Request, kind: Literal["chat", "completion"]
) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_json(request)
    reason = service.health()
    if reason is not None:
        err = ApiError(503, f"the cluster cannot serve yet: {reason}", code="service_unavailable")
        err.headers = {"Retry-After": "1"}  # a client that backs off by it comes back soon
        raise err
    parsed = await service.parse(kind, body)
    # the wire id is always ours: clients may send one x-request-id on concurrent requests
    rid = secrets.token_hex(12)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    req = service.submit(parsed, rid, client_request_id(request))
    echo_id = req.echo_id
    req.resumable = parsed.stream and request.headers.get("pdserve-resumable", "").lower() in TRUTHY
    try:
        if parsed.stream:
            return await _stream(request, req, prefix + rid, echo_id, ids=req.resumable)
        return await _collect(req, prefix + rid, echo_id)
    finally:
        service.end(req)
        _log_timeline(req, echo_id)


REQUEST_ID_CHARS = 256


def client_request_id(request: web.Request) -> str:
    """The client's x-request-id ("": none) as text: bytes that are no UTF-8 (aiohttp's
    surrogate escapes, which no encoder takes) replaced, so that the id its answer, its log
    and its stream's format on its nodes (a resume's answer) carry is the same."""
    raw = request.headers.get("x-request-id", "").encode("utf-8", "surrogateescape")
    # capped: it rides in every offer and KV header, and nodes keep it with their sequences
    return raw.decode("utf-8", "replace")[:REQUEST_ID_CHARS]


def _log_timeline(req: GatewayRequest, echo_id: str) -> None:
    """One structured record per request, under the id the client sent (or ours): phases
    in ms, the raw marks, and where it ran. JSON lines with --log-format json."""
    fields = {
        "event": "request",
        "request_id": req.request_id,
        "x_request_id": echo_id,
        "kind": req.kind,
        "outcome": req.outcome,
        "prompt_tokens": len(req.prompt_ids),
        "output_tokens": len(req.output_ids),
        "attempts": req.attempt + 1,
        "prefill_node": req.ran_on.get("prefill"),
        "decode_node": req.ran_on.get("decode"),
        "phases": req.phases(),
        "timeline": req.timeline,
    }
    timeline_log.info("request %s", echo_id, extra={"fields": fields})


async def _collect(req: GatewayRequest, rid: str, echo_id: str) -> web.Response:
    parts: list[str] = []
    while True:
        event = await req.events.get()
        match event:
            case Delta(text=text):
                parts.append(text)
            case Done(finish_reason=reason):
                use = usage(len(req.prompt_ids), len(req.output_ids))
                body = final_response(
                    req.kind, rid, req.model, req.created, "".join(parts), reason, use
                )
                if req.return_token_ids:  # vLLM's fields
                    body["choices"][0]["prompt_token_ids"] = req.prompt_ids
                    body["choices"][0]["token_ids"] = req.output_ids
                body["timings"] = req.phases()  # pdserve's own view, as llama.cpp reports one
                return json_response(body, headers={"x-request-id": echo_id})
            case Failed(status=status, message=message, code=code):
                return error_response(ApiError(status, message, code=code), retry_after(event))


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """`GET /v1/streams/{id}` with `Last-Event-ID`: the rest of a resumable stream whose
    gateway is gone, from any gateway of the cluster (gateway/resume.py)."""
    service = request.app[SERVICE]
    public_id = request.match_info["stream_id"]
    raw = request.headers.get("Last-Event-ID", request.query.get("last_event_id", "0"))
    have = Position.parse(raw)
    include_usage = request.query.get("include_usage", "").lower() in TRUTHY
    req = await service.resume(public_id, have, include_usage)
    req.resumable = req.announced = True  # its client may lose this connection too
    echo_id = req.echo_id  # the request's own, as its first response answered and logged
    try:
        return await _stream(request, req, public_id, echo_id, ids=True, resumed=have)
    finally:
        service.end(req)
        _log_timeline(req, echo_id)


async def _stream(
    request: web.Request,
    req: GatewayRequest,
    rid: str,
    echo_id: str,
    ids: bool = False,
    resumed: Position | None = None,
) -> web.StreamResponse:
    """The SSE response (gateway/stream_chunks.py). `ids`: each event carries `id:` =
    output tokens whose text the client has with it (what it resumes from), and the events
    after the text their name (gateway/stream_state.py); `resumed`: the last event its
    client has (sent none of)."""
    first = await req.events.get()
    if isinstance(first, Failed):  # nothing sent yet: a proper HTTP error
        headers = retry_after(first)
        return error_response(ApiError(first.status, first.message, code=first.code), headers)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "x-request-id": echo_id,
        }
    )
    await resp.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:  # a slow reader backs up into the handler soon (see STREAM_SNDBUF)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)

    conn = Connection(request, resp, request.app[CONFIG].send_timeout)
    if req.resumable:  # its client may resume it elsewhere: this connection is then dead
        req.hangup = conn.hangup
    chunks = StreamChunks(req, rid, ids, resumed)
    for data in chunks.opening():
        await conn.write(data)
        req.announced = True
    async for event in _events(first, req):
        for data in chunks.of(event):
            await conn.write(data)
            req.announced = True
    await conn.write(DONE)
    req.hangup = None
    await conn.end()
    return resp


async def _events(first: Any, req: GatewayRequest) -> AsyncIterator[Any]:
    event = first
    while True:
        yield event
        if isinstance(event, (Done, Failed)):
            return
        event = await req.events.get()


async def models(request: web.Request) -> web.Response:
    """GET /v1/models, and /v1/models/{model} (the OpenAI clients' `models.retrieve`)."""
    service = request.app[SERVICE]
    cards = [{"id": service.model_id, "object": "model", "created": int(time.time()),
              "owned_by": "pdserve", "max_model_len": service.max_model_len}]  # fmt: skip
    if "model" not in request.match_info:
        return json_response({"object": "list", "data": cards if service.model_id else []})
    name = request.match_info["model"]  # ids may hold slashes
    if not service.model_id or name != service.model_id:
        raise ApiError(404, f"the model '{name}' does not exist", "model", "model_not_found")
    return json_response(cards[0])


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    reason, nodes = service.health(), service.nodes()
    if reason is None:
        return json_response({"status": "ok", "nodes": nodes})
    return json_response({"status": "unavailable", "reason": reason, "nodes": nodes}, 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics_text()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    body = spec_json(request.app[SERVICE].model_id)
    return web.Response(body=body, content_type="application/json")


async def _gateway_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    gw = Gateway(cfg, Tokenizer.load(cfg.model))
    app[SERVICE] = gw.service
    await gw.start()
    yield
    await gw.stop()


TRUTHY = ("1", "true", "yes", "on")


def create_app(cfg: GatewayConfig) -> web.Application:
    cors = Cors(cfg.allowed_origins)  # its preflight answered before the key is checked
    middlewares = [cors.middleware, errors_middleware, auth_middleware]
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = cfg
    app.cleanup_ctx.append(_gateway_ctx)
    app.on_response_prepare.extend((count_status, cors.on_prepare))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/streams/{stream_id}", resume_stream, allow_head=False)  # it adopts
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


def serve(cfg: GatewayConfig) -> None:
    """Runs the gateway until SIGINT/SIGTERM (on uvloop where the caller installed it)."""

    def announce(*_: object) -> None:
        log.info("gateway on http://%s:%d", bracket(cfg.host), cfg.port)

    # backlog: aiohttp's 128 overflows in a burst of connections (hundreds of clients at once,
    # a flood of resumes): a dropped SYN costs its client a 1 s retransmit. uvicorn's 2048
    # (the kernel caps it at net.core.somaxconn). `::`: IPv4 too, as ZeroMQ's (asyncio's "")
    host = "" if cfg.host == "::" else cfg.host
    web.run_app(create_app(cfg), host=host, port=cfg.port, handler_cancellation=True,
                backlog=2048, access_log=None, print=announce)  # fmt: skip
