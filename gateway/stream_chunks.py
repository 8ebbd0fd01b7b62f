"""A streamed response's SSE events, as the bytes gateway/app.py writes: OpenAI's chunks,
the finish chunk with the server's `timings`, the usage chunk if asked, and [DONE]. With
`stream_options.continuous_usage_stats` (vLLM's) every chunk also carries the usage so far;
with `ids` (a resumable stream) every event but an error carries its `id:`
(gateway/stream_state.py). Pure: no sockets, no clock."""

from __future__ import annotations

from typing import Any

import orjson

from pdserve.gateway.openai_api import chunk, error_body, usage, usage_chunk
from pdserve.gateway.requests import Delta, Done, Event, Failed, GatewayRequest
from pdserve.gateway.stream_state import FINISH, USAGE, Position

DONE = b"data: [DONE]\n\n"


class StreamChunks:
    """The events of one stream, in order; `resumed`: the last event its client has (the
    events up to it are not made again)."""

    def __init__(
        self, req: GatewayRequest, rid: str, ids: bool = False, resumed: Position | None = None
    ) -> None:
        self.req, self.rid, self.ids, self.resumed = req, rid, ids, resumed
        self.had = resumed or Position(0)
        # output tokens whose text (covered) and ids (sent: return_token_ids) went out
        self.covered = self.sent = self.had.tokens

    def opening(self) -> list[bytes]:
        """Before the first event: a chat stream's role chunk (a resumed one's client has it)."""
        req = self.req
        if req.kind != "chat" or self.resumed is not None:
            return []
        return [self._chunk(chunk("chat", self.rid, req.model, req.created, "", role=True))]

    def of(self, event: Event) -> list[bytes]:
        """The SSE events for the request's next event, each to be written whole."""
        req = self.req
        match event:
            case Delta(text=text, token_ids=tokens):
                piece = chunk(req.kind, self.rid, req.model, req.created, text)
                if req.return_token_ids:
                    piece["choices"][0]["token_ids"] = tokens
                    if self.sent == 0:
                        piece["choices"][0]["prompt_token_ids"] = req.prompt_ids
                    self.sent += len(tokens)
                self.covered += len(tokens)
                return [self._chunk(piece)]
            case Done(finish_reason=reason):
                return self._end(reason)
            case Failed(status=status, message=message, code=code):
                # no id: the error is no position of the stream; its client's Last-Event-ID
                # stays that of the last chunk it has (docs/architecture.md, resume protocol)
                return [_data(error_body(status, message, code=code))]
        raise TypeError(f"not a stream event: {event!r}")

    def _end(self, reason: str) -> list[bytes]:
        req, out = self.req, []
        self.covered = len(req.output_ids)  # with tokens whose text never showed (a stop)
        if not self.had.has(FINISH):  # else its client has it, and all before it
            empty = None if req.kind == "chat" else ""
            last = chunk(req.kind, self.rid, req.model, req.created, empty, reason)
            # the server's own timings (ms: ttft, prefill, KV transfer, ...), as llama.cpp's
            # server reports them: a client tells its delays from ours
            last["timings"] = req.phases()
            if req.return_token_ids:  # tokens whose text never showed (a stop string)
                last["choices"][0]["token_ids"] = req.output_ids[self.sent :]
                if self.sent == 0:
                    last["choices"][0]["prompt_token_ids"] = req.prompt_ids
            out.append(self._chunk(last, FINISH))
        if req.include_usage and not self.had.has(USAGE):
            use = usage(len(req.prompt_ids), len(req.output_ids))
            out.append(self._chunk(usage_chunk(req.kind, self.rid, req.model, req.created, use),
                                   USAGE))  # fmt: skip
        return out

    def _chunk(self, obj: dict[str, Any], after: str = "") -> bytes:
        req = self.req
        if req.include_usage and "choices" in obj:  # OpenAI: null but in the usage chunk
            # vLLM's continuous_usage_stats: the tokens whose text the client has with it
            # (its id's count: a resumed stream counts on from its client's last event)
            so_far = usage(len(req.prompt_ids), self.covered) if req.continuous_usage else None
            obj.setdefault("usage", so_far)
        head = f"id: {Position(self.covered, after)}\n".encode() if self.ids else b""
        return head + _data(obj)


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
