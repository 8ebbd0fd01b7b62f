"""A client for streams that survive their gateway (docs/architecture.md, "Several gateways").

    async with aiohttp.ClientSession() as session:
        async for chunk in resumable_chunks(session, ["http://gw1:8000", "http://gw2:8000"],
                                            "/v1/completions", body):
            print(chunk["choices"][0]["text"], end="")

The request goes to the first URL with `pdserve-resumable: 1`, so every SSE event carries an
`id:` (the output tokens whose text it brings). If the connection drops before the stream
ends, the helper asks the next URL (round the list, at most `attempts` times) for
`GET /v1/streams/{id}` with `Last-Event-ID` and goes on reading: the text continues exactly
where it broke, no token lost, repeated or recomputed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


class StreamLost(Exception):
    """The stream could not be read to its end, on any gateway."""


def parse_event(raw: bytes) -> tuple[str | None, bytes | None]:
    """One SSE event (its lines, without the blank line): its `id` and `data` fields."""
    event_id, data = None, None
    for line in raw.split(b"\n"):
        if line.startswith(b"id:"):
            event_id = line[3:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].removeprefix(b" ")
    return event_id, data


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, bytes]]:
    """The events of an SSE body as they arrive: (`id`, `data`); events without data skipped."""
    buffer = b""
    async for data in content.iter_any():
        buffer += data
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            event_id, payload = parse_event(raw)
            if payload is not None:
                yield event_id, payload


async def resumable_chunks(
    session: aiohttp.ClientSession,
    urls: list[str],
    path: str,
    body: dict[str, Any],
    timeout: float = 600.0,
    attempts: int = 8,
    resumed: list[int] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Every chunk of the stream (parsed JSON), resumed across `urls` when a connection
    drops; `resumed`, if given, counts the resumptions (its first item). Raises StreamLost."""
    stream_id, last_id, turn = None, "0", 0
    pause = 0.5  # before asking again after a 409, 429 or 503 (a 429's Retry-After)
    request: Any = session.post(
        urls[0] + path, data=orjson.dumps({**body, "stream": True}),
        headers={"Content-Type": "application/json", "pdserve-resumable": "1"},
        timeout=aiohttp.ClientTimeout(total=timeout),
    )  # fmt: skip
    while True:
        try:
            async with request as resp:
                if resp.status in (409, 429, 503) and stream_id is not None:
                    # the nodes have not yet seen its gateway go (their heartbeat timeout),
                    # that gateway is still up, or this one looks for too many: ask again
                    # shortly (a 429's Retry-After)
                    retry = resp.headers.get("Retry-After", "")
                    pause = min(float(retry), 5.0) if retry.isdigit() else 0.5
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                if resp.status != 200:
                    raise StreamLost(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for event_id, payload in sse_events(resp.content):
                    if payload == b"[DONE]":
                        return
                    chunk = orjson.loads(payload)
                    stream_id = stream_id or chunk.get("id")
                    last_id = event_id if event_id is not None else last_id
                    yield chunk
            raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            turn += 1
            if stream_id is None or turn > attempts:
                raise StreamLost(f"{type(exc).__name__}: {exc}") from exc
            if isinstance(exc, aiohttp.ClientResponseError):
                await asyncio.sleep(pause)
        if resumed is not None:
            resumed[0] += 1
        url = urls[turn % len(urls)]
        request = session.get(
            f"{url}/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id},
            params={"include_usage": "true"} if _wants_usage(body) else None,
            timeout=aiohttp.ClientTimeout(total=timeout),
        )  # fmt: skip


def _wants_usage(body: dict[str, Any]) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))
