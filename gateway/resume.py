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
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from pdserve.common.aio import wait_event
from pdserve.common.logs import Every, cut
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.prefix import token_ids_problem
from pdserve.common.wire.protocol import REGISTERING, Adopt, Adopted
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.link import NodeLink
from pdserve.gateway.node_input import TOKEN_ID_LIMIT
from pdserve.gateway.openai_api import ApiError
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.stream_state import Position, StreamFormat
from pdserve.gateway.table import Phase, RequestTable

log = logging.getLogger("pdserve.gateway.core")
ROUND_S = 0.25  # a stream not found yet is asked for again this often
GAP_S = 0.02  # rounds at most this often: clients resuming together share one round
LET_GO_S = 5.0  # a Release is read long before (one control socket, in order)
PUBLIC_ID = re.compile(r"^(chatcmpl|cmpl)-([0-9a-f]{24})$")


Token = tuple[int, int, str | None]  # index, token id, finish reason
GAVE_BACK = "preempted"  # an Adopted's finish_reason: its node gave it back (protocol.py)
HELD = ("live gateway", REGISTERING, "in prefill")  # refusals of a node that holds it
# an Adopted no stream can be rebuilt from, kept as its node's refusal: the resume ends 502
MALFORMED = "a malformed answer"
FINAL = ("Last-Event-ID", MALFORMED)  # refusals that end a resume a round after (409, 502)


@dataclass
class _Asking:
    have: int  # output tokens the client has (its Last-Event-ID's count)
    answers: dict[str, Adopted] = field(default_factory=dict)  # node id -> its latest answer
    news: asyncio.Event = field(default_factory=asyncio.Event)  # an answer came
    due: float = 0.0  # when to ask the nodes (again); inf: not yet (its takeover, `_let_go`)
    # tokens the adopting node sent before its Adopted was read (another socket): by node
    early: dict[str, list[tuple[str, Token]]] = field(default_factory=dict)
    # the adopting node gave the stream back (preempted) before its Adopted was read:
    # node id -> (wire id, reason); the adopter places it again at once
    gave_back: dict[str, tuple[str, str]] = field(default_factory=dict)
    used: bool = False  # its found answer was taken (else, left unused, it is let go)
    since: dict[str, float] = field(default_factory=dict)  # first found / refused: when

    def found(self) -> tuple[str, Adopted] | None:
        """The latest attempt found: a node may still hold an older one (given back, then
        placed again elsewhere), whose use would place a second copy under the same id."""
        found = [(n, m) for n, m in self.answers.items() if m.found]
        return max(found, key=lambda f: _attempt(f[1].request_id), default=None)

    def settled(self, now: float, final: bool = False) -> tuple[str, Adopted] | None:
        """The answer to use: a running stream's at once. One given back (to be placed
        again) a round after it came, when the other nodes' answers to that round are in,
        and not while another node holds the stream (served, registering, in prefill: a
        newer attempt, perhaps); at the deadline (`final`), unless one does."""
        found = self.found()
        if found is None or found[1].finish_reason != GAVE_BACK:
            return found
        if any(h in m.reason for m in self.answers.values() if not m.found for h in HELD):
            return None
        return found if final or now - self.since["found"] >= ROUND_S else None

    def note(self, msg: Adopted, now: float) -> None:
        if msg.found or msg.reason.startswith(FINAL):
            self.since.setdefault("found" if msg.found else "refused", now)


class Busy(ApiError):
    """Too many streams looked for at once (`--max-resuming`): 429, retry after a second."""

    def __init__(self, limit: int) -> None:
        super().__init__(429, f"{limit} streams are being resumed here (--max-resuming); "
                         "retry later", code="rate_limit_exceeded")  # fmt: skip
        self.headers = {"Retry-After": "1"}  # a round or two frees room


class Resumes:
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        link: NodeLink,
        tokenizer: Tokenizer,
        model_id: Callable[[], str],
        timeout: float,
        limit: int,
        counted: Callable[[], None] = lambda: None,
        release: Callable[[str, str], None] = lambda wire_id, node_id: None,
    ) -> None:
        self.cluster, self.table, self.link, self.tokenizer = cluster, table, link, tokenizer
        self.model_id, self.timeout, self.limit = model_id, timeout, limit
        self.asking: dict[str, _Asking] = {}  # request id (no attempt) -> answers so far
        # wire ids let go to their node (a client left, `Release`) -> when: a heartbeat sent
        # before the node read the Release still names them ours; the lease must not free them
        self.let_go: dict[str, float] = {}
        # one task asks the nodes for every stream looked for (`_ask`): a message per node
        # per round however many clients resume, so a flood of resumes costs the nodes little
        self.counted = counted  # a round went out (pdserve:stream_resume_rounds_total)
        # `Release` to its node a stream adopted here but not served (the resume ended first,
        # or its rebuild failed): kept there for the client's next resume, not lost
        self.release = release
        self._wake = asyncio.Event()
        self._asker: asyncio.Task[None] | None = None
        self.said = Every(10.0)  # malformed answers: a log line at most every 10 s

    def answered(self, identity: bytes, msg: Adopted) -> None:
        node = self.cluster.by_identity(identity)
        rid = msg.request_id.rsplit(".", 1)[0] if msg.found else msg.request_id
        if msg.found and node is not None and (why := self._malformed(msg)) is not None:
            # nothing to rebuild the stream from: let go again (kept by its node, as any
            # answer not served), and the resume ends with why (502), none of it kept here
            if self.said.due():
                log.warning("dropping %s's Adopted of %s: %s", node.node_id, cut(rid), why)
            if self._served(rid) is None:  # a late copy for a stream served here: kept
                self.release(msg.request_id, node.node_id)
            why = f"{MALFORMED} from {node.node_id} for stream {cut(rid)}: {why}"
            msg = Adopted(request_id=rid, found=False, reason=why)
        asking = self.asking.get(rid)
        if node is None or asking is None:
            # nobody asks any more (it timed out, its client left): the node made it ours;
            # let it go again unless served here (a late copy of the answer used; or an
            # older attempt's, the request placed again since)
            if node is not None and msg.found and self._served(rid) is None:
                self.release(msg.request_id, node.node_id)
            return
        asking.answers[node.node_id] = msg
        asking.note(msg, time.monotonic())
        asking.news.set()

    def claims(self, wire_id: str) -> bool:
        """A stream being adopted here, or just let go: its node may name it as ours (a
        heartbeat's held ids) before the resume has put it in the table, or before it read
        the `Release`; the lease must not free it."""
        self._trim(time.monotonic())
        return wire_id.rsplit(".", 1)[0] in self.asking or wire_id in self.let_go

    def released(self, wire_id: str, now: float) -> None:
        self._trim(now)
        self.let_go.pop(wire_id, None)  # to the end: the oldest stays first, for `_trim`
        self.let_go[wire_id] = now

    def _trim(self, now: float) -> None:
        while self.let_go and now - next(iter(self.let_go.values())) > LET_GO_S:
            del self.let_go[next(iter(self.let_go))]

    def early(self, wire_id: str, node_id: str, index: int, token: int, reason: str | None
              ) -> None:  # fmt: skip
        """A token for a wire id not in the table: kept if its stream is being resumed."""
        asking = self.asking.get(wire_id.rsplit(".", 1)[0])
        if asking is not None and len(asking.early.setdefault(node_id, [])) < 4096:
            asking.early[node_id].append((wire_id, (index, token, reason)))

    def preempted(self, wire_id: str, node_id: str, reason: str) -> None:
        """A `Preempted` for a wire id not in the table: kept if its stream is being resumed
        (the node handed it to us, then gave it back, before our resume read the answer)."""
        asking = self.asking.get(wire_id.rsplit(".", 1)[0])
        if asking is not None:
            asking.gave_back[node_id] = (wire_id, reason)

    async def resume(
        self, public_id: str, have: Position, include_usage: bool
    ) -> tuple[GatewayRequest, list[Token], str | None]:
        """The adopted request, its events after `have` queued in its events, and the
        tokens its node sent before the adoption was read (for the caller to add); raises
        ApiError (404 unknown, 409 a position it does not have or a live stream); and why
        its node gave it back, if it did before the answer was read (to place it again)."""
        match = PUBLIC_ID.fullmatch(public_id)  # not .match: its $ passes a final newline
        if match is None:
            raise ApiError(404, f"no stream {public_id!r}: ids look like cmpl-<24 hex>",
                           code="not_found")  # fmt: skip
        kind: Literal["chat", "completion"] = "chat" if match[1] == "chatcmpl" else "completion"
        rid = match[2]
        live = self._served(rid)
        if rid in self.asking or (live is not None and not self._hangs_up(live)):
            raise ApiError(409, f"stream {public_id} is being served here", code="conflict")
        if len(self.asking) >= self.limit:
            raise Busy(self.limit)
        # not asked for while its takeover lets it go: a round then would adopt it from
        # the node while still ours, and the old handler's Release would orphan it again
        asking = self.asking[rid] = _Asking(have.tokens, due=math.inf if live else 0.0)
        deadline = time.monotonic() + self.timeout
        try:
            if live is not None and live.hangup is not None:
                # its client asks again: the connection it is streamed on is dead to it
                # (half-open, no FIN came); end that one, let the stream go, adopt it here
                live.hangup()
                await self._let_go(rid, public_id, deadline)
                asking.due = 0.0
            self._ask_soon()
            while True:
                now = time.monotonic()
                left = deadline - now
                if (found := asking.settled(now, final=left <= 0)) is not None:
                    break
                refused = [m.reason for m in asking.answers.values()]
                bad = [r for r in refused if r.startswith(FINAL)]
                late = left <= 0 or now - asking.since.get("refused", math.inf) >= ROUND_S
                if bad and late and not asking.found():  # an older attempt's node, perhaps
                    if bad[0].startswith(MALFORMED):
                        raise ApiError(502, bad[0], code="bad_gateway")
                    raise ApiError(409, bad[0], code="conflict")
                if left <= 0 and any("live gateway" in r for r in refused):
                    # its gateway answers the node still: the client may retry later
                    raise ApiError(409, f"stream {public_id} is still served by another "
                                   "gateway", code="conflict")  # fmt: skip
                if left <= 0 and REGISTERING in refused:  # adoptable once registered
                    raise ApiError(409, f"stream {public_id} is held by a node registering "
                                   "with this gateway again; retry", code="conflict")  # fmt: skip
                if left <= 0 and "in prefill" in refused:  # adoptable once its first token is
                    raise ApiError(409, f"stream {public_id} is still being prefilled",
                                   code="conflict")  # fmt: skip
                if left <= 0:
                    raise ApiError(404, f"no node holds stream {public_id} (never started, "
                                   "or ended or left longer ago than the nodes' "
                                   "--orphan-grace)", code="not_found")  # fmt: skip
                asking.news.clear()  # the other answers to a round, if any, by ROUND_S / 2
                await wait_event(asking.news, min(left, ROUND_S / 2) if asking.since else left)
            node_id, msg = found
            asking.used = True
            if msg.finish_reason == GAVE_BACK:  # preempted while orphaned: not ended, its
                # tokens are all here and nothing holds it: rebuilt, then placed again
                msg = msgspec.structs.replace(msg, finish_reason=None)
                asking.gave_back[node_id] = (msg.request_id, "given back while orphaned")
            try:
                req = self._rebuild(kind, node_id, msg, have, include_usage)
            except ApiError:
                self.release(msg.request_id, node_id)
                raise
            early = [t for w, t in asking.early.get(node_id, []) if w == msg.request_id]
            back = asking.gave_back.get(node_id)
        finally:
            if not asking.used and (unread := asking.found()) is not None:
                # answered, but the resume ended first (its client left, cancelling it): the
                # node made the stream ours; let it go for the client's next resume
                self.release(unread[1].request_id, unread[0])
            del self.asking[rid]
            self._wake.set()  # the rounds end with the last stream asked for
        return req, early, back[1] if back is not None and back[0] == msg.request_id else None

    def _served(self, rid: str) -> GatewayRequest | None:
        """The request `rid` (any attempt) if this gateway serves it."""
        return next((a.req for a in self.table if a.req.request_id == rid), None)

    def _hangs_up(self, live: GatewayRequest) -> bool:
        """A live stream here can be taken over by its client's resume: resumable, and on a
        node (not being placed again after losing one: nothing holds it to adopt)."""
        attempt = self.table.current(live)
        offered = attempt is None or attempt.phase is Phase.OFFERED
        return live.hangup is not None and not offered

    async def _let_go(self, rid: str, public_id: str, deadline: float) -> None:
        """Until the hung-up stream `rid` is let go (`Release`: at once in decode, once its
        KV lands in prefill); then a round, so the Release goes out before the Adopt."""
        while self._served(rid) is not None:
            if time.monotonic() >= deadline:
                raise ApiError(409, f"stream {public_id} is being served here",
                               code="conflict")  # fmt: skip
            await asyncio.sleep(GAP_S)
        await asyncio.sleep(GAP_S)

    async def stop(self) -> None:
        """Ends the rounds (the gateway is stopping: its sockets close next)."""
        if self._asker is not None:
            self._asker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._asker

    def _ask_soon(self) -> None:
        self._wake.set()
        if self._asker is None or self._asker.done():
            self._asker = asyncio.create_task(self._ask(), name="resume-rounds")

    async def _ask(self) -> None:
        """Rounds of `Adopt` while any stream is looked for: each round asks every node for
        the streams due (new ones, and those last asked `ROUND_S` ago) in one message."""
        while self.asking:
            now = time.monotonic()
            soon = now + ROUND_S / 2  # asked a little early, streams asked apart share rounds
            due = [(rid, a.have) for rid, a in self.asking.items() if a.due <= soon]
            if due:
                for rid, _ in due:
                    self.asking[rid].due = now + ROUND_S
                try:
                    await self._round(Adopt(streams=due))
                except Exception:  # one bad round must not end the asking for every stream
                    log.exception("a round of resumes failed")
                await asyncio.sleep(GAP_S)
                continue
            self._wake.clear()
            dues = [a.due for a in self.asking.values() if a.due < math.inf]
            if self.asking:  # all taken over: till one is let go (woken)
                wait = max(min(dues) - ROUND_S / 2 - now, 0.0) if dues else None
                await wait_event(self._wake, wait)

    async def _round(self, msg: Adopt) -> None:
        for node in list(self.cluster.nodes.values()):
            try:  # one node's socket failing must not keep the others from being asked
                await self.link.send(node, msg)
            except Exception:
                log.exception("asking %s for %d streams failed", node.node_id, len(msg.streams))
        self.counted()

    def _malformed(self, msg: Adopted) -> str | None:
        """Why the state a node handed over cannot be served, checked as token batches are;
        None: it can."""
        if msg.params is None:
            return "no sampling parameters"
        if _attempt(msg.request_id) < 0:
            return "its wire id has no attempt number"
        if not msg.prompt_ids:
            return "an empty prompt"
        vocab = self.cluster.vocab_size(self.tokenizer.vocab_size)  # what a node takes
        if (problem := token_ids_problem(msg.prompt_ids, vocab)) is not None:
            return f"prompt: {problem}"
        if msg.output_ids and not 0 <= min(msg.output_ids) <= max(msg.output_ids) < TOKEN_ID_LIMIT:
            return "an output token id outside 0..2**32-1"
        if not 0 <= msg.base <= len(msg.output_ids):
            return f"base {msg.base} outside its {len(msg.output_ids)} output tokens"
        if StreamFormat.decode(msg.stream_format) is None:
            return "an unreadable stream format"
        return None

    def _rebuild(self, kind: Literal["chat", "completion"], node_id: str, msg: Adopted,
                 have: Position, include_usage: bool) -> GatewayRequest:  # fmt: skip
        """The request as its first gateway had it: its output options and its client's
        x-request-id are its own (the resume's `include_usage` can only add the usage
        chunk)."""
        fmt = StreamFormat.decode(msg.stream_format)
        assert msg.params is not None and fmt is not None  # checked at its answer (`_malformed`)
        params = msgspec.structs.replace(msg.params, max_tokens=msg.base + msg.params.max_tokens)
        req = GatewayRequest(
            request_id=msg.request_id.rsplit(".", 1)[0], kind=kind, model=self.model_id(),
            prompt_ids=list(msg.prompt_ids), params=params, stream=True,
            include_usage=include_usage or fmt.include_usage, tokenizer=self.tokenizer,
            return_token_ids=fmt.return_token_ids, continuous_usage=fmt.continuous_usage,
            x_request_id=fmt.x_request_id,
        )  # fmt: skip
        req.created = fmt.created or req.created  # 0: kept by a node of an older version
        req.attempt = _attempt(msg.request_id)
        req.resumable = req.announced = True  # the client has its id: it may lose this one too
        req.ended_before = msg.finish_reason is not None
        try:
            req.replay(msg.output_ids, have.tokens, msg.base, msg.finish_reason, have.after)
        except ValueError as exc:  # not a position a chunk ended at: the client is confused;
            # not in our table, the request is freed on its node by our lease
            raise ApiError(409, str(exc), code="conflict") from exc
        req.ran_on = {"decode": node_id}
        if not req.finished:
            attempt = self.table.open(req, len(msg.prompt_ids) + msg.base)
            self.table.adopt(attempt, node_id, time.monotonic())
        log.info("resumed %s from event %s on %s (%d tokens so far)", req.request_id, have,
                 node_id, len(msg.output_ids))  # fmt: skip
        return req


def _attempt(wire_id: str) -> int:
    """The wire id's attempt number; -1 for none (isdigit alone passes "²", which int fails)."""
    tail = wire_id.rpartition(".")[2]
    return int(tail) if re.fullmatch(r"[0-9]{1,9}", tail) else -1
