"""The gateway's requests, from the HTTP handler's call to their last token.

`RequestService` is all the HTTP layer talks to (health, model, parse, submit, end); the node
messages and the liveness loop use its other half (tokens in, re-placement). A request whose
node dies, drains or preempts is re-placed as a prefill of prompt + generated tokens and keeps
streaming; after `max_replacements` losses it ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pdserve.common.config import GatewayConfig
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.wire.protocol import RELEASE_TOKENS, Abort, Release
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.link import NodeLink
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_api import ParsedRequest, parse_request
from pdserve.gateway.placement import PlacementTimeout, Placer
from pdserve.gateway.requests import Failed, GatewayRequest, StreamGap
from pdserve.gateway.resume import Busy, Resumes
from pdserve.gateway.sizing import Sizing
from pdserve.gateway.stream_state import Position
from pdserve.gateway.table import Attempt, Phase, RequestTable

log = logging.getLogger("pdserve.gateway.core")


class RequestService:
    def __init__(
        self,
        cfg: GatewayConfig,
        tokenizer: Tokenizer,
        cluster: ClusterView,
        table: RequestTable,
        placer: Placer,
        sizing: Sizing,
        metrics: GatewayMetrics,
        link: NodeLink,
    ) -> None:
        self.cfg, self.tokenizer, self.cluster, self.table = cfg, tokenizer, cluster, table
        self.placer, self.sizing, self.metrics, self.link = placer, sizing, metrics, link
        self.parser = ThreadPoolExecutor(2, thread_name_prefix="parse")  # tokenizing requests
        self.placing: dict[int, asyncio.Task[None]] = {}  # by id() of a submitted request
        # streams resumed from a gateway that is gone (gateway/resume.py)
        self.resumes = Resumes(cluster, table, link, tokenizer, lambda: self.model_id,
                               cfg.resume_timeout, cfg.max_resuming,
                               metrics.resume_rounds.inc, self._let_go)  # fmt: skip

    # -- for the HTTP layer ----------------------------------------------------------------
    @property
    def model_id(self) -> str:
        if self.cfg.served_model_name:
            return self.cfg.served_model_name
        ref = self.cluster.reference
        return ref.model_id if ref else ""

    @property
    def max_model_len(self) -> int:
        return self.cluster.max_model_len

    def health(self) -> str | None:
        """Why the cluster cannot serve yet, or None."""
        return self.cluster.health()

    def nodes(self) -> dict[str, str]:
        return {n.node_id: n.info.role for n in self.cluster.nodes.values()}

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def parse(self, kind: Literal["chat", "completion"], body: Any) -> ParsedRequest:
        # tokenizing a multi-megabyte prompt takes seconds: off the event loop, which must
        # keep answering nodes (an offer unanswered for --offer-timeout is lost)
        return await asyncio.get_running_loop().run_in_executor(
            self.parser, parse_request, kind, body, self.tokenizer, self.model_id,
            self.cluster.max_model_len, self.cluster.vocab_size(self.tokenizer.vocab_size),
        )  # fmt: skip

    def submit(self, parsed: ParsedRequest, request_id: str, x_request_id: str = ""
               ) -> GatewayRequest:  # fmt: skip
        """Start placing a parsed request (`x_request_id`: its client's, kept for a resume);
        its events (Delta, then Done or Failed) arrive in the returned request's `events`.
        `end` it when the HTTP exchange is over."""
        req = GatewayRequest(
            request_id=request_id,
            kind=parsed.kind,
            model=parsed.model,
            prompt_ids=parsed.prompt_ids,
            params=parsed.params,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            tokenizer=self.tokenizer,
            return_token_ids=parsed.return_token_ids,
            continuous_usage=parsed.continuous_usage,
            x_request_id=x_request_id,
        )
        self.placing[id(req)] = asyncio.create_task(self._run_or_fail(req))
        return req

    async def run(self, req: GatewayRequest) -> None:
        """Admit and place the request; its tokens then arrive in req.events."""
        self.sizing.arrived(len(req.prompt_ids), time.monotonic(), req.params.max_tokens)
        if len(self.placer.waiting) >= self.cfg.max_waiting:  # bounded, whatever the load
            waiting = len(self.placer.waiting)
            retry = max(1.0, self.placer.queued_seconds())
            self._refuse(req, Failed(429, f"{waiting} requests are waiting for a prefill node "
                                     "(--max-waiting); retry later", "rate_limit_exceeded",
                                     retry_after=retry))  # fmt: skip
            return
        if self.cfg.reject_ttft and (wait := self._overloaded(req)) is not None:
            self._refuse(req, Failed(503, "overloaded: the predicted time to first token "
                                     f"exceeds {self.cfg.reject_ttft:g} s; retry later",
                                     "service_unavailable", retry_after=wait))  # fmt: skip
            return
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))  # admitted: a refusal is no work
        await self._place(req, req.prompt_ids, req.params)

    async def resume(self, public_id: str, have: Position, include_usage: bool) -> GatewayRequest:
        """Adopt the stream `public_id` from the node holding it as an orphan; its events
        after `have` arrive in the returned request's events. `end` it too."""
        try:
            req, early, gave_back = await self.resumes.resume(public_id, have, include_usage)
        except Busy:
            self.metrics.resumes.labels("busy").inc()
            raise
        except Exception:
            self.metrics.resumes.labels("refused").inc()
            raise
        self.metrics.resumes.labels("adopted").inc()
        # made while orphaned, streamed from here; those a gateway streamed before but the
        # client did not read count twice (there, or here when it resumes at the same one)
        self.metrics.generation_tokens.inc(max(0, len(req.output_ids) - have.tokens))
        if req.finished:  # every token is in its events: it ended while orphaned, or
            # (decoding on past it) at a stop string the replay matched: ended on its node
            self._complete(req, abort_nodes=not req.ended_before)
        for index, token, reason in early:  # duplicates of replayed ones are dropped
            self.on_token(req, index, token, reason)
        attempt = self.table.current(req)
        if gave_back is not None and attempt is not None:  # preempted while being adopted
            self.spawn(self.replace(attempt, gave_back, "preempted"))
        return req

    def end(self, req: GatewayRequest) -> None:
        """The HTTP exchange is over (answered, or the client left): free what it holds; a
        resumable stream whose client left is kept on its node for a resume instead, once it
        had its id (in its first chunk: before that nobody can resume it)."""
        placing = self.placing.pop(id(req), None)
        if req.resumable and req.announced and not req.finished and self._detach(req):
            return  # accepted by a node: its placement is over
        if not req.finished or self.table.current(req) is not None:
            self.abort(req)
        if placing is not None and not placing.done():
            placing.cancel()

    def abort(self, req: GatewayRequest, reason: str = "client disconnected") -> None:
        """Free the request everywhere (client gone, stop string matched, error)."""
        if not req.finished:
            req.finish(Failed(499, reason, "cancelled"))
            self.metrics.requests.labels("cancelled").inc()
        self._release(req, notify=True)

    # -- for the node messages and the liveness loop ---------------------------------------
    def prefilled_locally(self, req: GatewayRequest, now: float) -> None:
        """Its decode node prefilled it itself (--local-prefill): work the prefill pool was
        not asked for, so not its demand (gateway/sizing.py)."""
        self.metrics.local_prefills.inc()
        self.sizing.prefilled_locally(len(req.prompt_ids), now)

    def on_token(self, req: GatewayRequest, index: int, token: int, reason: str | None,
                 node_id: str | None = None) -> None:  # fmt: skip
        """A token of `req` from `node_id` (None: its attempt's decode node)."""
        previous, count = req.last_token_at, len(req.output_ids)
        try:
            done = req.add_token(index, token, reason)
        except StreamGap as gap:
            if (attempt := self.table.current(req)) is not None:
                self.spawn(self.replace(attempt, f"token stream broken: {gap}"))
            return
        if len(req.output_ids) == count:
            return  # held back behind a gap, or a duplicate
        # as they stream (a gap filled adds several): a stream cancelled or failed midway
        # counts what its client got
        self.metrics.generation_tokens.inc(len(req.output_ids) - count)
        now = req.last_token_at or time.monotonic()
        if previous is None:
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.itl.observe(now - previous)
        if done:
            # a stop string (no finish reason from the node) leaves KV on the nodes: abort it
            self._complete(req, abort_nodes=reason is None, node_id=node_id)

    async def replace(self, attempt: Attempt, reason: str, kind: str = "lost") -> None:
        """Re-place the request of `attempt` as a prefill of prompt + generated tokens on the
        same stream.

        kind "lost": a node died or failed; these count against `max_replacements`.
        kind "preempted" / "no_room": a decode node gave it back; the request makes progress
        as others finish, so these do not count.

        Several triggers may name the same attempt before the first runs: only the first
        re-places it, the rest find a newer attempt (or none). Two placements of one request
        would each open an attempt and close the other's."""
        req = attempt.req
        if req.finished or self.table.current(req) is not attempt:
            return
        self._release(req, notify=True)
        if kind == "lost":
            req.losses += 1
            if req.losses > self.cfg.max_replacements:
                req.finish(Failed(503, f"request lost its node {req.losses} times ({reason})"))
                self.metrics.requests.labels("failed").inc()
                return
        self.metrics.replacements.labels(kind).inc()
        log.info(
            "re-placing %s after %s (%d tokens so far)", req.request_id, reason, len(req.output_ids)
        )
        prompt, params = req.next_attempt()
        try:
            await self._place(req, prompt, params)
        except Exception as exc:  # as a first placement's (`_run_or_fail`): a 500, not a hang
            log.exception("re-placing %s failed", req.request_id)
            self._release(req, notify=True)  # an attempt accepted meanwhile: aborted there
            if not req.finished:
                req.finish(Failed(500, f"internal error while placing again: {exc!r}"))
                self.metrics.requests.labels("failed").inc()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_log_failure)

    def close(self) -> None:
        for attempt in self.table:
            attempt.req.finish(Failed(503, "the gateway is shutting down", "service_unavailable"))
        self.parser.shutdown(wait=False, cancel_futures=True)

    # -- inside ----------------------------------------------------------------------------
    async def _run_or_fail(self, req: GatewayRequest) -> None:
        """Every request ends: a bug in placement answers 500 rather than leaving it waiting."""
        try:
            await self.run(req)
        except Exception as exc:
            log.exception("placing %s failed", req.request_id)
            req.finish(Failed(500, f"internal error while placing the request: {exc!r}"))

    def _refuse(self, req: GatewayRequest, failed: Failed) -> None:
        req.finish(failed)
        self.metrics.requests.labels("overloaded").inc()

    def _overloaded(self, req: GatewayRequest) -> float | None:
        """Early rejection: when requests already wait for prefill capacity and this one's
        predicted TTFT (its own prefill + the waiting prefill work, spread over the prefill
        nodes) exceeds `--reject-ttft`, the seconds after which to retry; else None. An idle
        cluster serves even a prompt longer than the limit."""
        queued = self.placer.queued_seconds()
        if queued <= 0:
            return None
        predicted = queued + self.placer.prefill_seconds(len(req.prompt_ids))
        return queued if predicted > self.cfg.reject_ttft else None

    async def _place(self, req: GatewayRequest, prompt_ids: list[int], params: Any) -> None:
        self.table.open(req, len(prompt_ids))
        req.mark(f"placing.{req.attempt}")
        start = time.monotonic()
        try:
            await self.placer.place(req, prompt_ids, params)
        except PlacementTimeout:
            self.table.close(req.wire_id)
            if req.finished:  # cancelled while it waited: counted as such already
                return
            timeout = self.cfg.placement_timeout
            req.finish(Failed(503, f"no prefill node accepted the request within {timeout:g} s; "
                              "retry later", "service_unavailable"))  # fmt: skip
            self.metrics.requests.labels("placement_timeout").inc()
            return
        if req.finished or self.table.current(req) is None:
            return  # its client left while it waited: not placed
        self.metrics.placement_wait.observe(time.monotonic() - start)
        req.mark(f"accepted.{req.attempt}")

    def _release(self, req: GatewayRequest, notify: bool, keep: set[str] | None = None
                 ) -> None:  # fmt: skip
        """Close its attempt; `notify`: abort it on its nodes (but `keep`, told otherwise)."""
        attempt = self.table.current(req)
        if attempt is None:
            return
        self.table.close(attempt.wire_id)
        if notify:
            for node_id in attempt.nodes() - (keep or set()):
                node = self.cluster.nodes.get(node_id)
                if node is not None:
                    self.spawn(self.link.send(node, Abort(request_id=attempt.wire_id)))
        self.placer.capacity_changed()

    def wanted(self, wire_id: str, node_id: str, taken: bool = False) -> None:
        """A client resumes `wire_id` at another gateway (`Wanted`, from a node holding it):
        it lost the connection this gateway streams it on; hang that up (the stream is then
        let go for the resume, `end`). `taken`: another gateway adopted it while this one was
        silent to the node: forgotten here at once (nothing is ours to let go), and hung up."""
        attempt = self.table.get(wire_id)
        if attempt is not None and taken and node_id in attempt.nodes():
            req = attempt.req
            log.info("%s: adopted by another gateway while this one was silent", wire_id)
            self._release(req, notify=False)
            if not req.finished:
                req.finish(Failed(409, "the stream was resumed at another gateway", "detached"))
                self.metrics.requests.labels("detached").inc()
            if req.hangup is not None:
                req.hangup()
            return
        if attempt is None or node_id not in attempt.nodes() or attempt.req.hangup is None:
            return
        if attempt.phase is Phase.OFFERED:  # placed again: nothing holds it to adopt
            return
        log.info("%s: resumed at another gateway, its connection here hung up", wire_id)
        attempt.req.hangup()

    def _detach(self, req: GatewayRequest) -> bool:
        """Keep a resumable stream whose client left for a resume at any gateway (this one
        too): once its KV is where it decodes, its node holds it as an orphan for
        `--orphan-grace` (`settle`). False while no node has accepted its first attempt:
        nothing to keep. One given back and waiting to be placed again has tokens its client
        may resume from: kept here until a node holds it, then let go there."""
        attempt = self.table.current(req)
        if attempt is None or (attempt.phase is Phase.OFFERED and req.attempt == 0):
            return False
        req.detached = True
        self.settle(req)
        return True

    def settle(self, req: GatewayRequest) -> None:
        """A detached stream whose KV is on its decode (or colocated) node alone: `Release` it
        there and forget it here; before that (prefill, KV on its way) it waits for this."""
        attempt = self.table.current(req)
        if not req.detached or req.finished or attempt is None:
            return
        if attempt.phase is not Phase.DECODE or attempt.nodes() != {attempt.decode}:
            return
        self._release(req, notify=False)
        req.finish(Failed(499, "the client left a resumable stream: kept for a resume",
                          "detached"))  # fmt: skip
        self.metrics.requests.labels("detached").inc()
        self._let_go(attempt.wire_id, attempt.decode)

    def _reads(self, node_id: str, feature: str) -> bool:
        node = self.cluster.nodes.get(node_id)
        return node is not None and feature in node.info.features

    def _let_go(self, wire_id: str, node_id: str | None, tokens: int = -1) -> None:
        """`Release` a resumable stream to its node: kept there for any gateway's resume
        (`tokens` >= 0: it ended here after those, a stop string; ended there too)."""
        node = self.cluster.nodes.get(node_id or "")
        if node is not None:
            self.resumes.released(wire_id, time.monotonic())
            self.spawn(self.link.send(node, Release(request_id=wire_id, tokens=tokens)))

    def _complete(self, req: GatewayRequest, abort_nodes: bool, node_id: str | None = None
                  ) -> None:  # fmt: skip
        if not req.ended_before:  # a replay of a stream that had ended: counted where it did
            self.metrics.requests.labels("ok").inc()
            self.metrics.e2e.observe(time.monotonic() - req.arrival)
            self.metrics.observe_phases(req.phases())
        attempt = self.table.current(req)  # none: resumed after it ended (gateway/resume.py)
        # where it ended: its first token's prefill node, or the decode node it migrated from
        decode = node_id or (attempt.decode if attempt is not None else req.ran_on.get("decode"))
        # its client may not have the last chunks (they can sit in a dead connection's
        # buffers): its node keeps the ended stream for a resume, as an orphan's. One ended
        # here by a stop string is ended at that token on every node that may hold it (the
        # node it came from may have handed it on): told instead of aborted
        keep = {decode} if req.resumable and decode is not None else set()
        if keep and abort_nodes:
            keep |= attempt.nodes() if attempt is not None else set()
            # a node of an older version reads `Release(tokens)` as a plain `Release` and
            # would decode a stopped stream on: aborted, as before that field
            keep = {n for n in keep if self._reads(n, RELEASE_TOKENS)}
        self._release(req, notify=abort_nodes, keep=keep)
        for held_by in keep:
            self._let_go(req.wire_id, held_by, len(req.output_ids) if abort_nodes else -1)


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
