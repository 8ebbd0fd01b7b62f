"""What a resume needs to write the rest of a stream as its first gateway would have
(docs/architecture.md, "Several gateways"): where its client is in it (`Position`, the SSE
`id:` of the last event it has) and how its chunks are written (`StreamFormat`, the
request's output options, kept with the request on its nodes and handed back by `Adopted`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from pdserve.gateway.openai_api import ApiError

# the events after a stream's last text chunk, in order, named in their ids (`12.finish`): a
# client that has one of them resumes after it, not after the last text chunk (same count)
FINISH, USAGE = "finish", "usage"
TRAILERS = (FINISH, USAGE)
_ID = re.compile(rf"([0-9]{{1,9}})(?:\.({'|'.join(TRAILERS)}))?")  # none is 10^9 tokens


@dataclass(frozen=True)
class Position:
    """An event's id: `tokens`, the output tokens whose text the client has with it, and
    for an event after the text (`after`), which one."""

    tokens: int
    after: str = ""

    @classmethod
    def parse(cls, raw: str) -> Position:
        match = _ID.fullmatch(raw.strip())
        if match is None:
            raise ApiError(400, "Last-Event-ID must be the id of the last event received (N or "
                           f"N.finish or N.usage, N from 0 to 999999999), got {raw[:64]!r}",
                           param="Last-Event-ID")  # fmt: skip
        return cls(int(match[1]), match[2] or "")

    def has(self, trailer: str) -> bool:
        """Whether a client at this position has the event `trailer` (one of TRAILERS)."""
        return bool(self.after) and TRAILERS.index(self.after) >= TRAILERS.index(trailer)

    def __str__(self) -> str:
        return f"{self.tokens}.{self.after}" if self.after else str(self.tokens)


class StreamFormat(msgspec.Struct, frozen=True, kw_only=True):
    """The request's own output options, its chunks' `created` and its client's
    `x-request-id`: a gateway that adopts the stream writes its chunks with these (a
    resume's `?include_usage=true` can only add the usage chunk) and answers with that id.
    Nodes keep them as bytes they do not read (`PrefillOffer.stream_format`): a new option
    needs no new node version. A field missing from an older gateway's bytes takes its
    default; an older gateway skips the fields it does not know."""

    created: int = 0
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False  # vLLM's
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    x_request_id: str = ""  # the client's header ("": none, the stream's own id answered)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: bytes) -> StreamFormat | None:
        """The format a node kept; None: unreadable. An empty one (a request from a gateway
        or through a node of a version before formats were kept) is the defaults, created 0."""
        try:
            return msgspec.msgpack.decode(raw, type=cls) if raw else cls()
        except msgspec.DecodeError:  # ValidationError included
            return None
