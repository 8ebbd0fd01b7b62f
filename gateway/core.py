"""The gateway's ZeroMQ side: node registry, placement, token demultiplexing, failures.

Sockets: a ROUTER that nodes register, heartbeat and answer offers on, and a PULL that
decode nodes push token batches to. Every request lives in `requests` under its wire id
(`id.attempt`). When a node dies, drains or preempts, its requests are re-placed as a
prefill of prompt + generated tokens and keep streaming; after `max_replacements` they
end with an error. A client that goes away triggers Abort on every node holding the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.config import GatewayConfig
from pdserve.common.protocol import (
    NODE_DECODER,
    TOKENS_DECODER,
    Abort,
    Accept,
    Deregister,
    FirstToken,
    Heartbeat,
    HeartbeatReply,
    KvTransferred,
    Msg,
    NeedDecode,
    Preempted,
    PrefillFailed,
    PrefillOffer,
    Redirect,
    Register,
    RegisterAck,
    RegisterRefuse,
    Reject,
    TokenBatch,
)
from pdserve.common.sampling import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import (
    CONTROL_MAX_MSG,
    TOKENS_MAX_MSG,
    decode_or_none,
    make_socket,
    send,
)
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.placement import PlacementTimeout, Placer
from pdserve.gateway.requests import Failed, GatewayRequest, StreamGap
from pdserve.gateway.schedulers import make_policy

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tokenizer_fingerprint = tokenizer.fingerprint()
        self.cluster = ClusterView(cfg.heartbeat_timeout)
        self.policy = make_policy(cfg.scheduler, cfg.cost_profile)
        self.requests: dict[str, GatewayRequest] = {}  # by wire id
        self.ctx = zmq.asyncio.Context()
        self.control = make_socket(
            self.ctx,
            "gateway.control",
            f"tcp://{_bind_host(cfg.host)}:{cfg.control_port}",
            max_msg=CONTROL_MAX_MSG,
        )
        self.tokens = make_socket(
            self.ctx,
            "gateway.tokens",
            f"tcp://{_bind_host(cfg.host)}:{cfg.tokens_port}",
            max_msg=TOKENS_MAX_MSG,
        )
        # an empty host tells each node to use the host it registered through (common/node.py)
        self.tokens_address = f"tcp://{cfg.advertise_host}:{cfg.tokens_port}"
        self.placer = Placer(
            self.cluster,
            self.policy,
            self._send_offer,
            cfg.placement_timeout,
            cfg.offer_timeout,
            on_answer=self._count_answer,
            renew=self._renew_wire_id,
        )
        self.metrics = GatewayMetrics(self.cluster, self.placer.waiting)
        self.tasks: list[asyncio.Task] = []
        self.parser = ThreadPoolExecutor(2, thread_name_prefix="parse")  # tokenizing requests

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.tasks = [
            asyncio.create_task(c)
            for c in (self._control_loop(), self._tokens_loop(), self._liveness_loop())
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for req in list(self.requests.values()):
            req.finish(Failed(503, "the gateway is shutting down", "service_unavailable"))
        self.parser.shutdown(wait=False, cancel_futures=True)
        self.control.close()
        self.tokens.close()
        self.ctx.term()

    @property
    def model_id(self) -> str:
        if self.cfg.served_model_name:
            return self.cfg.served_model_name
        ref = self.cluster.reference
        return ref.model_id if ref else ""

    # -- requests --------------------------------------------------------------------------
    async def run(self, req: GatewayRequest) -> None:
        """Place the request; tokens then arrive through the loops into req.events."""
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        await self._place(req, req.prompt_ids, req.params)

    async def _place(
        self, req: GatewayRequest, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        self.requests[req.wire_id] = req
        req.mark(f"placing.{req.attempt}")
        start = time.monotonic()
        try:
            await self.placer.place(req, prompt_ids, params)
        except PlacementTimeout:
            self.requests.pop(req.wire_id, None)
            req.finish(
                Failed(
                    503,
                    f"no prefill node accepted the request within "
                    f"{self.cfg.placement_timeout:g} s; retry later",
                    "service_unavailable",
                )
            )
            self.metrics.requests.labels("placement_timeout").inc()
            return
        self.metrics.placement_wait.observe(time.monotonic() - start)
        req.mark(f"accepted.{req.attempt}")

    def _renew_wire_id(self, req: GatewayRequest) -> None:
        """An offer went unanswered: the node may still accept it later, so the request goes
        on under a new wire id and that late acceptance can be aborted without touching the
        live one (which may be on the same node)."""
        old = req.wire_id
        self.requests.pop(old, None)
        placing = req.timeline.get(f"placing.{req.attempt}")
        req.attempt += 1
        if placing is not None:
            req.timeline[f"placing.{req.attempt}"] = placing
        self.requests[req.wire_id] = req

    def abort(self, req: GatewayRequest, reason: str = "client disconnected") -> None:
        """Free the request everywhere (client gone, stop string matched, error)."""
        if not req.finished:
            req.finish(Failed(499, reason, "cancelled"))
            self.metrics.requests.labels("cancelled").inc()
        self._release(req, notify=True)

    def _release(self, req: GatewayRequest, notify: bool) -> None:
        wire_id = req.wire_id
        self.requests.pop(wire_id, None)
        for node_id in {req.prefill_node, req.decode_node} - {None}:
            node = self.cluster.nodes.get(node_id)  # type: ignore[arg-type]
            if node is None:
                continue
            node.in_prefill.pop(wire_id, None)
            node.decoding.discard(wire_id)
            if notify:
                self._spawn(self._send_node(node, Abort(request_id=wire_id)))
        self.placer.capacity_changed()

    def _complete(self, req: GatewayRequest, abort_nodes: bool) -> None:
        self.metrics.requests.labels("ok").inc()
        self.metrics.generation_tokens.inc(len(req.output_ids))
        self.metrics.e2e.observe(time.monotonic() - req.arrival)
        self.metrics.observe_phases(req.phases())
        self._release(req, notify=abort_nodes)

    def _on_token(
        self, req: GatewayRequest, index: int, token: int, finish_reason: str | None
    ) -> None:
        previous, count = req.last_token_at, len(req.output_ids)
        try:
            done = req.add_token(index, token, finish_reason)
        except StreamGap as gap:
            self._spawn(self.replace(req, f"token stream broken: {gap}"))
            return
        if len(req.output_ids) == count:
            return  # held back behind a gap, or a duplicate
        now = req.last_token_at or time.monotonic()
        if previous is None:
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.itl.observe(now - previous)
        if done:
            # a stop string (no finish reason from the node) leaves KV on the nodes: abort it
            self._complete(req, abort_nodes=finish_reason is None)

    async def replace(self, req: GatewayRequest, reason: str, kind: str = "lost") -> None:
        """Re-place a request as a prefill of prompt + generated tokens on the same stream.

        kind "lost": a node died or failed; these count against `max_replacements`.
        kind "preempted" / "no_room": a decode node gave it back; the request makes progress
        as others finish, so these do not count."""
        if req.finished:
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
        await self._place(req, prompt, params)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_log_failure)

    # -- node messages ---------------------------------------------------------------------
    async def _send_node(self, node: NodeState, msg: Msg) -> None:
        try:
            await send(self.control, msg, to=node.identity)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): liveness will drop it
            log.warning("cannot reach %s: %s", node.node_id, exc)

    async def _send_offer(self, node: NodeState, offer: PrefillOffer) -> None:
        try:
            await send(self.control, offer, to=node.identity)
        except zmq.ZMQError as exc:  # peer gone: an OSError, so the placer tries the next node
            raise ConnectionError(f"cannot reach {node.node_id}: {exc}") from exc

    def _count_answer(self, node: NodeState, accepted: bool | None) -> None:
        if accepted is None:
            self.metrics.offer_timeouts.labels(node.node_id).inc()
        elif accepted:
            node.accepts += 1
            self.metrics.accepts.labels(node.node_id).inc()
        else:
            node.rejects += 1
            self.metrics.rejects.labels(node.node_id).inc()

    async def _control_loop(self) -> None:
        """Anyone who reaches the control port can send anything: a message that is not one
        identity frame plus one well-formed payload is logged and dropped, and no message,
        however handled, ends this loop."""
        while True:
            frames = await self.control.recv_multipart()
            msg = decode_or_none(NODE_DECODER, frames[1]) if len(frames) == 2 else None
            if msg is None:
                log.warning(
                    "dropping malformed control message (%d frames) from %r",
                    len(frames),
                    frames[0][:64],
                )
                continue
            try:
                await self._on_node_message(frames[0], msg)
            except Exception:
                log.exception("handling %s failed", type(msg).__name__)

    async def _on_node_message(self, identity: bytes, msg: object) -> None:
        now = time.monotonic()
        match msg:
            case Heartbeat(node_id=node_id, load=load):
                known = self.cluster.heartbeat(node_id, identity, load, now)
                stale = tuple(r for r in load.held if r not in self.requests) if known else ()
                await send(
                    self.control, HeartbeatReply(stale=stale, unknown_node=not known), to=identity
                )
                self.placer.capacity_changed()
            case Accept(request_id=rid) | Reject(request_id=rid):
                accepted = isinstance(msg, Accept)
                if not self.placer.answer(rid, identity, accepted) and accepted:
                    # too late: that offer timed out and the request moved on under a new
                    # wire id, so this aborts exactly the stale acceptance
                    await send(self.control, Abort(request_id=rid), to=identity)
            case FirstToken(request_id=rid, token_id=token, finish_reason=reason):
                req = self.requests.get(rid)
                node = self.cluster.by_identity(identity)
                if node is not None:
                    node.in_prefill.pop(rid, None)
                self.placer.capacity_changed()
                if req is None or node is None or req.prefill_node != node.node_id:
                    return  # an old attempt's, or not from the node that holds the request
                req.mark(f"prefilled.{req.attempt}")
                req.timeline[f"prefill_ms.{req.attempt}"] = round(msg.prefill_ms, 3)
                req.timeline[f"queue_ms.{req.attempt}"] = round(msg.queue_ms, 3)
                if reason is not None:
                    req.prefill_node = None  # the node already freed its KV
                self._on_token(req, msg.index, token, reason)
            case KvTransferred(request_id=rid):
                node = self.cluster.by_identity(identity)
                self.metrics.kv_bytes.labels(node.node_id if node else "?", msg.backend).inc(
                    msg.bytes
                )
                self.metrics.kv_seconds.labels(msg.backend).observe(
                    (msg.end_ms - msg.start_ms) / 1000
                )
                req = self.requests.get(rid)
                if req is not None:
                    req.timeline[f"kv_transfer.{req.attempt}"] = {  # type: ignore[assignment]
                        "backend": msg.backend,
                        "bytes": msg.bytes,
                        "layerwise": msg.layerwise,
                        "start_ms": round(msg.start_ms, 3),
                        "end_ms": round(msg.end_ms, 3),
                    }
            case NeedDecode(request_id=rid, refused_by=refused):
                await self._redirect(identity, rid, refused)
            case PrefillFailed(request_id=rid, reason=why):
                req = self.requests.get(rid)
                node = self.cluster.by_identity(identity)
                if req is not None and node is not None and req.prefill_node == node.node_id:
                    # spawned, not awaited: the re-placement waits for an Accept this loop reads
                    self._spawn(self.replace(req, f"prefill failed: {why}"))
            case Register(info=info):
                reason = self.cluster.register(info, identity, now, self.tokenizer_fingerprint)
                if reason is None:
                    log.info("registered %s node %s (%s)", info.role, info.node_id, info.model_id)
                    await send(
                        self.control,
                        RegisterAck(node_id=info.node_id, tokens_address=self.tokens_address),
                        to=identity,
                    )
                    self.placer.capacity_changed()
                else:
                    log.warning("refused node %s: %s", info.node_id, reason)
                    await send(
                        self.control,
                        RegisterRefuse(node_id=info.node_id, reason=reason),
                        to=identity,
                    )
            case Deregister(node_id=node_id):
                node = self.cluster.nodes.get(node_id)
                if node is not None and node.identity == identity:
                    await self._drop_node(node_id, "node left")
            case _:
                log.warning("unexpected control message %s", type(msg).__name__)

    async def _redirect(self, identity: bytes, rid: str, refused: str) -> None:
        req = self.requests.get(rid)
        node = self.cluster.by_identity(identity)
        if req is None or req.finished or node is None or req.prefill_node != node.node_id:
            await send(self.control, Redirect(request_id=rid, decode=None), to=identity)
            return
        old = self.cluster.nodes.get(refused)
        if old is not None:
            old.decoding.discard(rid)
        target = self.policy.pick_decode(
            self.cluster.alive("decode"), len(req.prompt_ids) + len(req.output_ids), {refused}
        )
        if target is None:
            await send(self.control, Redirect(request_id=rid, decode=None), to=identity)
            # spawned, not awaited: the re-placement waits for an Accept this loop reads
            self._spawn(
                self.replace(req, f"{refused} refused and no decode node had room", "no_room")
            )
            return
        target.decoding.add(rid)
        req.decode_node = target.node_id
        await send(self.control, Redirect(request_id=rid, decode=target.target()), to=identity)

    async def _tokens_loop(self) -> None:
        while True:
            payload = await self.tokens.recv()
            try:
                self._on_tokens(decode_or_none(TOKENS_DECODER, payload))
            except Exception:
                log.exception("handling a token message failed")

    def _on_tokens(self, msg: object) -> None:
        match msg:
            case TokenBatch() if msg.well_formed():
                for rid, token, index, reason in zip(
                    msg.request_ids, msg.token_ids, msg.indices, msg.finish_reasons, strict=True
                ):
                    req = self.requests.get(rid)
                    # only from the node the request's KV went to (None: its Accept, on the
                    # other socket, is not read yet; the wire id alone is this attempt's)
                    if req is not None and req.decode_node in (None, msg.node_id):
                        self._on_token(req, index, token, reason)
            case Preempted(request_id=rid, reason=why):
                req = self.requests.get(rid)
                if req is not None and req.decode_node == msg.node_id:
                    self._spawn(self.replace(req, why, "preempted"))
            case _:
                log.warning("dropping malformed token message")

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.cfg.heartbeat_timeout / 4))
            now = time.monotonic()
            for node_id in self.cluster.expired(now):
                await self._drop_node(node_id, "heartbeat timeout")
            for req in list(self.requests.values()):
                # a token that waits this long for an earlier one waits for a lost message:
                # the attempt is broken, never shown as text with a hole in it
                if req.gap_since is not None and now - req.gap_since > self.cfg.stream_gap_timeout:
                    req.gap_since = None
                    self._spawn(self.replace(req, f"token {len(req.output_ids)} never arrived"))

    async def _drop_node(self, node_id: str, why: str) -> None:
        node = self.cluster.remove(node_id)
        if node is None:
            return
        log.warning("dropped node %s: %s", node_id, why)
        for rid in set(node.in_prefill) | node.decoding:
            req = self.requests.get(rid)
            if req is not None:
                self._spawn(self.replace(req, f"{node.info.role} node {node_id}: {why}"))
        self.placer.capacity_changed()


def _bind_host(host: str) -> str:
    return "*" if host in ("0.0.0.0", "") else host


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
