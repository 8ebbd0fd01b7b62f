"""What the gateway takes off its node sockets before a handler sees it: each message decoded
and counted by type, and what cannot be used dropped with a word in the log at most every
10 s per socket. Anyone who reaches those ports may send anything, as fast as they like: a
line per message, or per token of one 16 MB batch (4M lines, ~45 s of formatting on the
gateway's event loop), was a flood of its own."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.common.logs import Every, cut
from pdserve.common.wire.protocol import NODE_DECODER, TOKENS_DECODER, TokenBatch
from pdserve.common.wire.transport import decode_or_none
from pdserve.gateway.cluster import TOKEN_ID_LIMIT
from pdserve.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)
Entry = tuple[str, int, int, str | None]  # request id, token id, its index, finish reason
SAY_EVERY_S = 10.0


class NodeInput:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.counted: dict[str, Any] = {}  # node_messages' child per message type
        self.control_said, self.tokens_said = Every(SAY_EVERY_S), Every(SAY_EVERY_S)

    def control(self, frames: list[bytes]) -> Any:
        """The message of one identity frame and one well-formed payload, else None."""
        msg = decode_or_none(NODE_DECODER, frames[1]) if len(frames) == 2 else None
        self._count(msg)
        if msg is None and self.control_said.due():
            log.warning("dropping malformed control message (%d frames) from %r",
                        len(frames), frames[0][:64])  # fmt: skip
        return msg

    def tokens(self, data: bytes) -> Any:
        """The message, or None for a malformed one."""
        msg = decode_or_none(TOKENS_DECODER, data)
        self._count(msg)
        if msg is None and self.tokens_said.due():
            log.warning("dropping malformed token message")
        return msg

    def entries(self, msg: TokenBatch) -> list[Entry] | None:
        """The batch's entries whose token id the detokenizer takes (the others dropped with
        one warning for the batch), or None for a batch of unequal lists."""
        if not msg.well_formed():
            if self.tokens_said.due():
                log.warning("dropping a token batch of unequal lists from %s", cut(msg.node_id))
            return None
        rows = zip(msg.request_ids, msg.token_ids, msg.indices, msg.finish_reasons, strict=True)
        good = [row for row in rows if 0 <= row[1] < TOKEN_ID_LIMIT]
        if (bad := len(msg.token_ids) - len(good)) and self.tokens_said.due():
            log.warning("dropping %d of the %d tokens of a batch from %s: ids outside 0..2**32-1",
                        bad, len(msg.token_ids), cut(msg.node_id))  # fmt: skip
        return good

    def _count(self, msg: object) -> None:
        kind = type(msg).__name__ if msg is not None else "malformed"
        if (child := self.counted.get(kind)) is None:
            child = self.counted[kind] = self.metrics.node_messages.labels(kind)
        child.inc()
