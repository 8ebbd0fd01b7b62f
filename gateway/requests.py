"""One client request as the gateway tracks it: placement attempts, tokens, text, timeline.

Tokens arrive from the prefill node (the first) and the decode node (the rest) over two
sockets, so they can arrive out of order; each carries its index among the attempt's output
tokens and `add_token` places it by index: duplicates are dropped, a token ahead of a gap
waits in `pending` until the gap fills (the gateway treats a gap that stays open as a lost
attempt), and only the contiguous prefix is detokenized and checked for stop strings. The HTTP
handler reads `events`: a `Delta` of the text produced since it last read (tokens that
arrive while it writes join the waiting Delta: a slow client gets bigger chunks, the queue
never grows past one Delta), then one `Done` or `Failed`. A request re-placed after
preemption or a node's death keeps its stream: only its wire id (`request_id.attempt`)
changes, so late messages for an old attempt are ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pdserve.common.model.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from pdserve.common.sampling import SamplingParams
from pdserve.gateway.stream_state import StreamFormat


@dataclass
class Delta:
    text: str
    token_ids: list[int]  # the tokens this text completes (held-back ones included)


@dataclass
class Done:
    finish_reason: str


@dataclass
class Failed:
    status: int
    message: str
    code: str = "server_error"
    retry_after: float | None = None  # 503, 429: seconds after which a retry may succeed


Event = Delta | Done | Failed
MAX_PENDING = 4096  # tokens held back behind a gap before the attempt counts as broken


class StreamGap(Exception):
    """Too many tokens wait behind a missing one: the attempt's stream is broken."""


@dataclass
class GatewayRequest:
    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tokenizer: Tokenizer
    return_token_ids: bool = False  # vLLM's: token ids beside the text
    # vLLM's stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    continuous_usage: bool = False
    x_request_id: str = ""  # the client's x-request-id header, "" none
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    attempt: int = 0
    base: int = 0  # output tokens before this attempt: its token index i is output_ids[base + i]
    pending: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # index -> token
    gap_since: float | None = None  # when a token first waited for an earlier one
    losses: int = 0  # re-placements because a node died or failed
    ran_on: dict[str, str] = field(default_factory=dict)  # last placement (the log; a resumed end)
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)
    unsent: list[int] = field(default_factory=list)  # tokens whose text is held back
    outcome: str = "unfinished"  # stop, length, or the error code
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    last_delta: Delta | None = None  # the last Delta queued (see `_send`)
    muted: int = 0  # a resumed stream: the client has the text of this many output tokens
    resumable: bool = False  # a stream whose client may resume it (`pdserve-resumable: 1`)
    announced: bool = False  # a chunk (with the stream's id) went out: resumable from then
    detached: bool = False  # its client left: let go to its node once its KV is there
    ended_before: bool = False  # resumed after it had ended on its node (counted there)
    # a resumable stream's: ends the connection it streams on (its client resumes elsewhere)
    hangup: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self.stops = StopStringMatcher(list(self.params.stop))

    @property
    def wire_id(self) -> str:
        return f"{self.request_id}.{self.attempt}"

    @property
    def echo_id(self) -> str:
        """Its `x-request-id` answer and log name: the client's, else the stream's own id."""
        return self.x_request_id or self.request_id

    def mark(self, event: str) -> None:
        self.timeline[event] = round((time.monotonic() - self.arrival) * 1000, 3)

    def next_attempt(self) -> tuple[list[int], SamplingParams]:
        """Prompt and params for re-placing: prompt + generated tokens, remaining budget."""
        self.attempt += 1
        self.base = len(self.output_ids)
        self.pending.clear()
        self.gap_since = None
        remaining = self.params.max_tokens - len(self.output_ids)
        params = msgspec.structs.replace(self.params, max_tokens=max(1, remaining))
        return self.prompt_ids + self.output_ids, params

    def add_token(self, index: int, token_id: int, finish_reason: str | None) -> bool:
        """Place the attempt's token `index`; returns True when the request is now finished
        (by the node's finish reason or by a stop string matched here). Raises StreamGap when
        more than MAX_PENDING tokens wait for a missing one."""
        if self.finished:
            return True
        position = self.base + index
        if position < len(self.output_ids) or index in self.pending:
            return False  # a duplicate
        if position > len(self.output_ids):
            if len(self.pending) >= MAX_PENDING:
                raise StreamGap(f"{len(self.pending)} tokens wait for token {len(self.output_ids)}")
            self.pending[index] = (token_id, finish_reason)
            if self.gap_since is None:
                self.gap_since = time.monotonic()
            return False
        done = self._append(token_id, finish_reason)
        while not done and (nxt := len(self.output_ids) - self.base) in self.pending:
            done = self._append(*self.pending.pop(nxt))
        # a gap filled; another may remain (tokens still wait): timed from now, not from the
        # first gap's start (it would be re-placed early, counted as a loss)
        self.gap_since = time.monotonic() if self.pending else None
        return done

    def _append(self, token_id: int, finish_reason: str | None) -> bool:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.mark("first_token")
        self.last_token_at = now
        self.output_ids.append(token_id)
        self.unsent.append(token_id)
        if len(self.output_ids) == 2:
            self.mark("decode_start")  # the first token from the decode side
        # a stop token's own text is not output (vLLM's rule; the single-process engine's)
        stop_token = finish_reason == "stop" and token_id in self.params.stop_token_ids
        text = self.stops.feed("" if stop_token else self.detok.add(token_id))
        if self.stops.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.stops.flush()
        if text:  # a token whose text is held back (partial UTF-8, stop prefix) sends nothing
            self._send(text)
        if finish_reason is not None:
            self.finish(Done("stop" if finish_reason == "stop" else "length"))
            return True
        return False

    def stream_format(self) -> bytes:
        """Its output options, kept with it on its nodes for a gateway that adopts it."""
        return StreamFormat(created=self.created, include_usage=self.include_usage,
                            return_token_ids=self.return_token_ids,
                            continuous_usage=self.continuous_usage,
                            x_request_id=self.x_request_id).encode()  # fmt: skip

    def replay(self, outputs: list[int], have: int, base: int, finish: str | None,
               after: str = "") -> None:  # fmt: skip
        """A resumed stream (gateway/resume.py): the tokens generated so far, `base` of them
        by earlier attempts; the text of the first `have` is the client's already, so only
        the rest is queued. `have` must be where a chunk ended (its text complete), and with
        `after` (the client has that event after the text) where the stream ended: else
        ValueError."""
        if not 0 <= have <= len(outputs):  # the node checked it, against the client's word
            raise ValueError(f"Last-Event-ID {have} is not a position of this stream")
        self.muted = have
        for i, token in enumerate(outputs):
            if self.finished:  # a stop string: its node decoded past it, orphaned
                break
            if i == have and self.unsent:
                raise ValueError(f"Last-Event-ID {have} is not where a chunk of this stream "
                                 "ended")  # fmt: skip
            self._append(token, finish if i == len(outputs) - 1 else None)
        if have == len(outputs) and self.unsent and not self.finished:
            raise ValueError(f"Last-Event-ID {have} is not where a chunk of this stream ended")
        if after and not (self.finished and have == len(self.output_ids)):
            raise ValueError(f"Last-Event-ID {have}.{after}: this stream did not end at {have}")
        self.base = base

    def _send(self, text: str) -> None:
        """Queue the text for the client. While the handler has not taken the last Delta
        (the queue is not empty, so the last one put is still in it) the text joins that
        Delta: a client that reads slowly gets several tokens per SSE chunk, and a stream
        holds at most one unsent Delta, never one per token."""
        if len(self.output_ids) <= self.muted:  # resumed: the client has this text
            self.unsent = []
            return
        if self.events.qsize() and self.last_delta is not None:
            self.last_delta.text += text
            self.last_delta.token_ids += self.unsent
        else:
            self.last_delta = Delta(text, self.unsent)
            self.events.put_nowait(self.last_delta)
        self.unsent = []

    def phases(self) -> dict[str, float]:
        """Where the time went, in ms: the timeline's marks turned into durations of the
        last placement attempt (gateway wait, prefill queue, prefill, KV transfer, decode
        wait), plus TTFT, TPOT and end to end. Phases a request never reached are absent."""
        t, a = self.timeline, self.attempt
        out: dict[str, float] = {}
        if f"placing.{a}" in t and f"accepted.{a}" in t:
            out["gateway_wait_ms"] = round(t[f"accepted.{a}"] - t[f"placing.{a}"], 3)
        for key, name in (("queue_ms", "prefill_queue_ms"), ("prefill_ms", "prefill_ms")):
            if f"{key}.{a}" in t:
                out[name] = round(t[f"{key}.{a}"], 3)
        kv: Any = t.get(f"kv_transfer.{a}")
        if isinstance(kv, dict):
            out["kv_transfer_ms"] = round(kv["end_ms"] - kv["start_ms"], 3)
        if "first_token" in t:
            out["ttft_ms"] = t["first_token"]
            if "decode_start" in t:
                out["decode_wait_ms"] = round(t["decode_start"] - t["first_token"], 3)
            if "finish" in t and len(self.output_ids) > 1:
                tpot = (t["finish"] - t["first_token"]) / (len(self.output_ids) - 1)
                out["tpot_ms"] = round(tpot, 3)
        if "finish" in t:
            out["e2e_ms"] = t["finish"]
        return out

    def finish(self, event: Done | Failed) -> None:
        if not self.finished:
            self.finished = True
            self.outcome = event.finish_reason if isinstance(event, Done) else event.code
            self.mark("finish")
            self.events.put_nowait(event)
