"""Many concurrent streaming requests against a gateway, for stress tests: one aiohttp session,
every response read to its end, and each request's outcome (status, text, error, time)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdserve.common.engine.sim import FIRST_ORDINARY_TOKEN, ORDINARY_TOKEN_SPAN
from pdserve.common.model.tokenizer import IncrementalDetokenizer
from pdserve.common.sampling import counter_int


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    error: str = ""  # an SSE error event, a non-200 body, or the client's exception
    chunks: int = 0
    seconds: float = 0.0
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)  # the gateway's, from the last chunk
    sent: float = 0.0  # time.monotonic() when it was sent

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.finish_reason is not None


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float
) -> StreamResult:
    result = StreamResult()
    start = result.sent = time.monotonic()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with session.post(
            url + path, data=orjson.dumps(body), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            result.status = resp.status
            if resp.status != 200 or not body.get("stream"):
                raw = await resp.read()
                _on_body(result, raw)
            else:
                buffer = b""
                async for data in resp.content.iter_any():
                    buffer += data
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        _on_event(result, event)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - start
    return result


def _on_body(result: StreamResult, raw: bytes) -> None:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        result.error = f"not JSON: {raw[:200]!r}"
        return
    if isinstance(obj, dict) and "error" in obj:
        result.error = str(obj["error"])
        return
    choice = obj["choices"][0]
    result.text = choice.get("text") or choice.get("message", {}).get("content", "")
    result.finish_reason = choice.get("finish_reason")
    result.usage = obj.get("usage") or {}


def _on_event(result: StreamResult, event: bytes) -> None:
    if not event.startswith(b"data: ") or event == b"data: [DONE]":
        return
    obj = orjson.loads(event[6:])
    if "error" in obj:
        result.error = str(obj["error"])
        return
    if obj.get("usage"):
        result.usage = obj["usage"]
    if obj.get("timings"):
        result.timings = obj["timings"]
    for choice in obj.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        result.text += text
        result.chunks += bool(text)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


async def _many(
    url: str | list[str], bodies: list[dict[str, Any]], timeout: float, spacing: float
) -> list[StreamResult]:
    connector = aiohttp.TCPConnector(limit=0)
    urls = [url] if isinstance(url, str) else url

    async def later(i: int, body: dict[str, Any]) -> StreamResult:
        await asyncio.sleep(i * spacing)
        return await _one(session, urls[i % len(urls)], body, timeout)

    async with aiohttp.ClientSession(connector=connector) as session:
        return list(await asyncio.gather(*(later(i, b) for i, b in enumerate(bodies))))


def run_streams(
    url: str | list[str], bodies: list[dict[str, Any]], timeout: float = 60.0, spacing: float = 0.0
) -> list[StreamResult]:
    """Send every body (all at once, or one every `spacing` seconds: a steady load) and wait
    for all of them; each ends or times out `timeout` seconds after it was sent. Several
    URLs (gateways of one cluster): body i goes to URL i mod their count."""
    return asyncio.run(_many(url, bodies, timeout, spacing))


def sim_text(tokenizer: Any, prompt: list[int], seed: int, n: int) -> str:
    """What the sim engine generates for this prompt and seed, detokenized as the gateway does."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    ids = [
        FIRST_ORDINARY_TOKEN + counter_int(seed, len(prompt) + i, ORDINARY_TOKEN_SPAN)
        for i in range(n)
    ]
    return "".join(detok.add(t) for t in ids)


def stopped_half_way(text: str) -> tuple[str, list[str]]:
    """A stop string first found in the second half of `text`, and the text it leaves."""
    for at in range(len(text) // 2, len(text) - 6):
        stop = text[at : at + 6]
        if text.index(stop) == at:
            return text[:at], [stop]
    raise AssertionError("no stop string found once in the second half")


def seeded_bodies(count: int, max_tokens: int) -> list[dict[str, Any]]:
    """`count` streamed seeded requests of 300-token prompts, all different (sim text known)."""
    return [
        {"prompt": list(range(1000 + 9 * i, 1300 + 9 * i)), "max_tokens": max_tokens, "seed": i,
         "temperature": 1.0, "ignore_eos": True, "stream": True}
        for i in range(count)
    ]  # fmt: skip


class SteadyLoad:
    """A steady stream load that runs until told to stop: body `make_body(i)` is sent every
    `spacing` seconds from a thread (at most `cap`) until `stop()`; each request ends or
    times out `timeout` seconds after it was sent. A fault test keeps it running until every
    fault has been driven, however slow the machine, instead of betting on a fixed length."""

    def __init__(
        self,
        url: str,
        make_body: Callable[[int], dict[str, Any]],
        spacing: float,
        timeout: float = 60.0,
        cap: int = 10_000,
    ) -> None:
        self.url, self.make_body, self.spacing = url, make_body, spacing
        self.timeout, self.cap = timeout, cap
        self.bodies: list[dict[str, Any]] = []
        self.results: list[StreamResult] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> SteadyLoad:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Send no more; `join` waits for those sent to end."""
        self._stop.set()

    def join(self) -> bool:
        """Wait for every request sent to end (each within its timeout); False if hung."""
        self.thread.join(self.timeout * 2 + 30)
        return not self.thread.is_alive()

    async def _run(self) -> None:
        start = time.monotonic()
        tasks: list[asyncio.Task[StreamResult]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while not self._stop.is_set() and len(tasks) < self.cap:
                body = self.make_body(len(tasks))
                self.bodies.append(body)
                tasks.append(asyncio.create_task(_one(session, self.url, body, self.timeout)))
                next_at = start + len(tasks) * self.spacing
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self.results = list(await asyncio.gather(*tasks))


def streams_in_background(
    url: str, bodies: list[dict[str, Any]], results: list[StreamResult]
) -> threading.Thread:
    """Start `bodies` as streams (one every 50 ms) on a thread filling `results`."""
    load = threading.Thread(
        target=lambda: results.extend(run_streams(url, bodies, 60, spacing=0.05))
    )
    load.start()
    return load
