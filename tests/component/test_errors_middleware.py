"""Every failure of a gateway handler leaves as OpenAI's JSON error object, even one no
handler expected (a bug, a chat template raising what nobody caught): a logged 500, not
aiohttp's plain-text page; and a stream already under way is cut, not followed by a second
response on the same connection."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from pdserve.common.wire.transport import free_port
from pdserve.gateway.app import errors_middleware


async def _boom(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("a bug")


async def _boom_mid_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: {}\n\n")
    raise RuntimeError("a bug mid-stream")


async def test_an_unexpected_exception_is_a_logged_json_500_and_a_stream_is_cut(caplog):
    app = web.Application(middlewares=[errors_middleware])
    app.router.add_get("/boom", _boom)
    app.router.add_get("/stream", _boom_mid_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/boom") as resp:
                assert resp.status == 500
                assert resp.content_type == "application/json"
                error = (await resp.json())["error"]
                assert error["type"] == "server_error" and "a bug" not in error["message"]
            assert "GET /boom failed" in caplog.text and "a bug" in caplog.text
            async with session.get(f"http://127.0.0.1:{port}/stream") as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            async with session.get(f"http://127.0.0.1:{port}/boom") as resp:
                assert resp.status == 500  # the server is still serving
    finally:
        await runner.cleanup()
