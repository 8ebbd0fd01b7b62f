"""A client for streams that survive their gateway (docs/architecture.md, "Several gateways").

    async with aiohttp.ClientSession() as session:
        async for chunk in resumable_chunks(session, ["http://gw1:8000", "http://gw2:8000"],
                                            "/v1/completions", body):
            print(chunk["choices"][0]["text"], end="")

The request goes to the first URL with `pdserve-resumable: 1`, so every SSE event carries an
`id:` (the output tokens whose text it brings). If the connection drops before the stream
ends, the helper asks the next URL (round the list, at most `attempts` times) for
`GET /v1/streams/{id}` with `Last-Event-ID` and goes on reading: the text continues exactly
where it broke, no token lost, repeated or recomputed. A URL that refuses the connection is
not asked again for that stream while another remains.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


class StreamLost(Exception):
    """The stream could not be read to its end, on any gateway; `status`: the HTTP status
    that ended it (0: none, the connection)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def parse_event(raw: bytes) -> tuple[str | None, bytes | None]:
    """One SSE event (its lines, without the blank line): its `id` and `data` fields. Lines
    end in \\n, \\r\\n or \\r, and several `data:` lines are one value joined by \\n (the
    SSE spec: a server may split a payload over lines, and keeping the last lost the rest)."""
    event_id, data = None, []
    for line in raw.splitlines():
        name, colon, value = line.partition(b":")
        value = value.removeprefix(b" ") if colon else b""
        if name == b"id":
            event_id = value.strip().decode()
        elif name == b"data":
            data.append(value)
    return event_id, b"\n".join(data) if data else None


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole events at the head of `buffer` (each without its blank line) and the rest,
    line endings made \\n. A trailing \\r waits for the next read, which may bring its \\n
    (taken alone it would end a line, and the \\n a second: a blank line, mid-event)."""
    held = buffer.endswith(b"\r")
    text = (buffer[:-1] if held else buffer).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    *events, rest = text.split(b"\n\n")
    return events, rest + b"\r" * held


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, bytes]]:
    """The events of an SSE body as they arrive: (`id`, `data`); events without data skipped."""
    buffer = b""
    async for data in content.iter_any():
        events, buffer = split_events(buffer + data)
        for raw in events:
            event_id, payload = parse_event(raw)
            if payload is not None:
                yield event_id, payload
    for raw in last_events(buffer):
        event_id, payload = parse_event(raw)
        if payload is not None:
            yield event_id, payload


def last_events(rest: bytes) -> list[bytes]:
    """At the body's end: the event a held \r ended (a CR-only stream's last one; no read
    follows to bring a \n), else none (a partial event is no event)."""
    return split_events(rest[:-1] + b"\n")[0] if rest.endswith(b"\r") else []


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
    stream_id, last_id, turn, url, live = None, "0", 0, urls[0], list(urls)
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
                if resp.status == 400 and "." in last_id and stream_id is not None:
                    # a gateway from before the end's own ids (N.finish, N.usage) takes the
                    # count alone (and sends the stream's end again)
                    last_id = last_id.split(".")[0]
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=400)
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise StreamLost(f"HTTP {resp.status}: {text}", resp.status)
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
            status = exc.status if isinstance(exc, aiohttp.ClientResponseError) else 0
            if stream_id is None or turn > attempts:
                raise StreamLost(f"{type(exc).__name__}: {exc}", status) from exc
            if isinstance(exc, aiohttp.ClientResponseError):
                await asyncio.sleep(pause)
            url = next_url(live, url, exc)
        if resumed is not None:
            resumed[0] += 1
        request = session.get(
            f"{url}/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id},
            params={"include_usage": "true"} if _wants_usage(body) else None,
            timeout=aiohttp.ClientTimeout(total=timeout),
        )  # fmt: skip


def next_url(live: list[str], url: str, exc: BaseException) -> str:
    """The URL to ask after `url` failed with `exc`, round `live`. One that refused the
    connection (a gateway gone) leaves `live` while another remains: asked in turn, it took
    every other attempt."""
    at = live.index(url)
    os_error = getattr(exc, "os_error", None)
    if getattr(os_error, "errno", None) == errno.ECONNREFUSED and len(live) > 1:
        live.pop(at)
        return live[at % len(live)]
    return live[(at + 1) % len(live)]


def _wants_usage(body: dict[str, Any]) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))
