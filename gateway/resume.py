"""Resuming a stream whose gateway is gone or whose connection dropped (docs/architecture.md,
"Several gateways").

A client that asked for a resumable stream (`pdserve-resumable: 1`) gets an SSE `id:` with
every chunk: the count of output tokens whose text it has received. When its connection
drops, it asks any gateway for `GET /v1/streams/{id}` with `Last-Event-ID`. That gateway asks
every node (`Adopt`); the one holding the request as an orphan (its gateway silent or gone,
or one that let it go when its client left: `Release`, common/node/adoption.py) answers
with its state and streams to this gateway from then on.
The gateway rebuilds the request (prompt, tokens so far, sampling), replays the tokens the
client has without sending their text, sends the rest, and carries on as for any request:
no token is lost, repeated or recomputed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.wire.protocol import Adopt, Adopted
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.link import NodeLink
from pdserve.gateway.openai_api import ApiError
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.table import RequestTable

log = logging.getLogger("pdserve.gateway.core")
ROUND_S = 0.25  # one round of asking every node
LET_GO_S = 5.0  # a Release is read long before (one control socket, in order)
PUBLIC_ID = re.compile(r"^(chatcmpl|cmpl)-([0-9a-f]{24})$")


Token = tuple[int, int, str | None]  # index, token id, finish reason


@dataclass
class _Asking:
    answers: list[tuple[str, Adopted]] = field(default_factory=list)  # (node id, answer)
    found: asyncio.Event = field(default_factory=asyncio.Event)
    # tokens the adopting node sent before its Adopted was read (another socket): by node
    early: dict[str, list[tuple[str, Token]]] = field(default_factory=dict)


class Resumes:
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        link: NodeLink,
        tokenizer: Tokenizer,
        model_id: Callable[[], str],
        timeout: float,
    ) -> None:
        self.cluster, self.table, self.link, self.tokenizer = cluster, table, link, tokenizer
        self.model_id, self.timeout = model_id, timeout
        self.asking: dict[str, _Asking] = {}  # request id (no attempt) -> answers so far
        # wire ids let go to their node (a client left, `Release`) -> when: a heartbeat sent
        # before the node read the Release still names them ours; the lease must not free them
        self.let_go: dict[str, float] = {}

    def answered(self, identity: bytes, msg: Adopted) -> None:
        node = self.cluster.by_identity(identity)
        rid = msg.request_id.rsplit(".", 1)[0] if msg.found else msg.request_id
        asking = self.asking.get(rid)
        if node is None or asking is None:
            # nobody asks any more (it timed out): the node made it ours, and our lease
            # (the heartbeat's stale ids) frees it there
            return
        asking.answers.append((node.node_id, msg))
        if msg.found:
            asking.found.set()

    def claims(self, wire_id: str) -> bool:
        """A stream being adopted here, or just let go: its node may name it as ours (a
        heartbeat's held ids) before the resume has put it in the table, or before it read
        the `Release`; the lease must not free it."""
        return wire_id.rsplit(".", 1)[0] in self.asking or wire_id in self.let_go

    def released(self, wire_id: str, now: float) -> None:
        while self.let_go and now - next(iter(self.let_go.values())) > LET_GO_S:
            del self.let_go[next(iter(self.let_go))]
        self.let_go[wire_id] = now

    def early(self, wire_id: str, node_id: str, index: int, token: int, reason: str | None
              ) -> None:  # fmt: skip
        """A token for a wire id not in the table: kept if its stream is being resumed."""
        asking = self.asking.get(wire_id.rsplit(".", 1)[0])
        if asking is not None and len(asking.early.setdefault(node_id, [])) < 4096:
            asking.early[node_id].append((wire_id, (index, token, reason)))

    async def resume(
        self, public_id: str, have: int, include_usage: bool
    ) -> tuple[GatewayRequest, list[Token]]:
        """The adopted request, its text from token `have` on queued in its events, and the
        tokens its node sent before the adoption was read (for the caller to add); raises
        ApiError (404 unknown, 409 a position it does not have or a live stream)."""
        match = PUBLIC_ID.match(public_id)
        if match is None:
            raise ApiError(404, f"no stream {public_id!r}: ids look like cmpl-<24 hex>",
                           code="not_found")  # fmt: skip
        kind: Literal["chat", "completion"] = "chat" if match[1] == "chatcmpl" else "completion"
        rid = match[2]
        if rid in self.asking or any(a.req.request_id == rid for a in self.table):
            raise ApiError(409, f"stream {public_id} is being served here", code="conflict")
        asking = self.asking[rid] = _Asking()
        deadline = time.monotonic() + self.timeout
        try:
            while not asking.found.is_set():
                refused = [m.reason for _, m in asking.answers if not m.found]
                if any(r.startswith("Last-Event-ID") for r in refused):
                    raise ApiError(409, next(r for r in refused if r.startswith("Last")),
                                   code="conflict")  # fmt: skip
                if time.monotonic() >= deadline and any("live gateway" in r for r in refused):
                    # its gateway answers the node still: the client may retry later
                    raise ApiError(409, f"stream {public_id} is still served by another "
                                   "gateway", code="conflict")  # fmt: skip
                if time.monotonic() >= deadline:
                    raise ApiError(404, f"no node holds stream {public_id} (finished and "
                                   "delivered, never started, or past the nodes' "
                                   "--orphan-grace)", code="not_found")  # fmt: skip
                asking.answers.clear()
                for node in list(self.cluster.nodes.values()):
                    await self.link.send(node, Adopt(request_id=rid, have=have))
                try:
                    await asyncio.wait_for(asking.found.wait(), ROUND_S)
                except TimeoutError:
                    pass
            node_id, msg = next((n, m) for n, m in asking.answers if m.found)
            req = self._rebuild(kind, node_id, msg, have, include_usage)
            early = [t for w, t in asking.early.get(node_id, []) if w == msg.request_id]
        finally:
            del self.asking[rid]
        return req, early

    def _rebuild(self, kind: Literal["chat", "completion"], node_id: str, msg: Adopted,
                 have: int, include_usage: bool) -> GatewayRequest:  # fmt: skip
        assert msg.params is not None
        params = msgspec.structs.replace(msg.params, max_tokens=msg.base + msg.params.max_tokens)
        req = GatewayRequest(
            request_id=msg.request_id.rsplit(".", 1)[0], kind=kind, model=self.model_id(),
            prompt_ids=list(msg.prompt_ids), params=params, stream=True,
            include_usage=include_usage, tokenizer=self.tokenizer,
        )  # fmt: skip
        req.attempt = int(msg.request_id.rsplit(".", 1)[1])
        try:
            req.replay(msg.output_ids, have, msg.base, msg.finish_reason)
        except ValueError as exc:  # not a position a chunk ended at: the client is confused;
            # not in our table, the request is freed on its node by our lease
            raise ApiError(409, str(exc), code="conflict") from exc
        if not req.finished:
            attempt = self.table.open(req, len(msg.prompt_ids) + msg.base)
            self.table.adopt(attempt, node_id, time.monotonic())
        log.info("resumed %s from token %d on %s (%d tokens so far)", req.request_id, have,
                 node_id, len(msg.output_ids))  # fmt: skip
        return req
