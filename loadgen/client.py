"""The streaming client: one OpenAI request, a timestamp per SSE chunk.

`/v1/completions` takes the workload's token-id prompts (exact lengths) or text;
`/v1/chat/completions` (`--endpoint chat`) takes the prompt as the text of one user message,
so the server's chat template and tokenizer are measured as outside clients meet them. Both
stream with `stream_options.include_usage`, so output tokens come from `usage`. A chunk
"carries content" when its choice has non-empty text (or delta content). A server that reports
its own timings in the final chunk (pdserve's and llama.cpp's `timings`) gives the
server-side TTFT too, next to the client-side one.
"""

from __future__ import annotations

import time

import aiohttp
import orjson

from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.resumable import (
    StreamLost,
    last_events,
    parse_event,
    resumable_chunks,
    split_events,
)
from pdserve.loadgen.workloads import RequestSpec


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str | None,
    spec: RequestSpec,
    index: int,
    ignore_eos: bool,
    timeout: float,
    endpoint: str = "completions",
    token_ids: bool = False,
    others: list[str] | None = None,
) -> RequestRecord:
    """One streamed request; with `token_ids`, the output's token ids are asked for (vLLM's
    `return_token_ids`) and kept, so that a conversation continues from exact tokens. With
    `others` (the cluster's other gateways), the stream is resumable: a dropped connection
    resumes on them (loadgen/resumable.py)."""
    body: dict = {
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
    }
    if endpoint == "chat":
        assert isinstance(spec.prompt, str), "chat prompts are text (loadgen.workloads.as_text)"
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if model:
        body["model"] = model
    if token_ids:
        body["return_token_ids"] = True
    record = RequestRecord(index=index, sent=time.monotonic(), prompt_tokens=spec.prompt_len)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if others:
        return await _send_resumable(session, [url, *others], path, body, record, timeout)
    try:
        async with session.post(
            f"{url}{path}",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            record.status = resp.status
            if resp.status != 200:
                record.error = (await resp.text())[:500]
                record.done = time.monotonic()
                return record
            buffer, finished = b"", False
            async for data in resp.content.iter_any():
                # every event of one read gets its time: events that came together (a client
                # behind the server) give gaps of 0, as one event of several tokens (pdserve
                # merges what waits) gives one gap; either way what the client saw
                now = time.monotonic()
                events, buffer = split_events(buffer + data)
                for event in events:
                    finished = _on_event(record, event, now) or finished
            for event in last_events(buffer):
                finished = _on_event(record, event, time.monotonic()) or finished
            # a server that closed mid-stream (its process gone) is a failure, as the
            # resumable path takes it for a drop, not a short answer
            if not finished and not record.error:
                record.error = "the stream ended without [DONE] or a finish reason"
    except Exception as exc:  # a timeout, a reset, garbage: this request failed, not the run
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.done = time.monotonic()
    if not record.error and not record.chunk_times:
        record.error = "no content"
    return record


async def _send_resumable(
    session: aiohttp.ClientSession,
    urls: list[str],
    path: str,
    body: dict,
    record: RequestRecord,
    timeout: float,
) -> RequestRecord:
    resumed = [0]
    try:
        async for obj in resumable_chunks(session, urls, path, body, timeout, resumed=resumed):
            _on_chunk(record, obj, time.monotonic())
        record.status = 200
    except StreamLost as exc:
        record.error, record.status = str(exc)[:500], exc.status
    except Exception as exc:  # as in send(): one request's failure, never the run's
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.resumed = resumed[0]
    record.done = time.monotonic()
    if not record.error and not record.chunk_times:
        record.error = "no content"
    return record


def _on_event(record: RequestRecord, event: bytes, now: float) -> bool:
    """Takes one event into `record`; True for the stream's end: `data: [DONE]`, or a chunk
    with a finish reason (servers that send no [DONE] after it, as some llama.cpp builds)."""
    _, payload = parse_event(event)
    if payload is None or payload == b"[DONE]":
        return payload is not None
    obj = orjson.loads(payload)
    _on_chunk(record, obj, now)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices or ())


def _on_chunk(record: RequestRecord, obj: dict, now: float) -> None:
    if "error" in obj:
        error = obj["error"]
        text = str(error.get("message", error) if isinstance(error, dict) else error)
        # an error with an empty message is still one (as "" it counted as no error)
        record.error = (text or "error event")[:500]
        return
    usage = obj.get("usage")
    if usage:
        record.output_tokens = int(usage["completion_tokens"])
        record.prompt_tokens = int(usage["prompt_tokens"])
    timings = obj.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("ttft_ms"), (int, float)):
        record.server_ttft = timings["ttft_ms"] / 1000
    if isinstance(timings, dict):
        waits = [timings.get(k) for k in ("gateway_wait_ms", "prefill_queue_ms")]
        if any(isinstance(w, (int, float)) for w in waits):
            record.server_wait = sum(w for w in waits if isinstance(w, (int, float))) / 1000
    for choice in obj.get("choices", []):
        record.token_ids += choice.get("token_ids") or []
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            record.chunk_times.append(now)
