"""The gateway's ZeroMQ side: sockets, the request table, placement, failures.

Sockets: a ROUTER that nodes register, heartbeat and answer offers on, and a PULL that
decode nodes push token batches to. Node messages are dispatched by one handler table
(gateway/node_messages.py). Where every request runs is held in one place, the request table
(gateway/table.py); placement decisions come from `plan()` and the placer runs the offer
protocol. When a node dies, drains or preempts, its requests are re-placed as a prefill of
prompt + generated tokens and keep streaming; after `max_replacements` losses they end with an
error. A client that goes away triggers Abort on every node holding the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.config import GatewayConfig
from pdserve.common.protocol import Abort, Msg, PrefillOffer
from pdserve.common.security import ClusterKey, close_context, make_context, watch_handshakes
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import CONTROL_MAX_MSG, TOKENS_MAX_MSG, make_socket, send
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.node_messages import NodeMessages
from pdserve.gateway.placement import Admission, PlacementTimeout, Placer
from pdserve.gateway.policies import make_policy
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.requests import Failed, GatewayRequest, StreamGap
from pdserve.gateway.roles import RoleSwitcher
from pdserve.gateway.selective import LocalPrefill, parse_mode
from pdserve.gateway.sizing import Sizing
from pdserve.gateway.table import Attempt, RequestTable

log = logging.getLogger(__name__)


class Gateway(NodeMessages, PoolCare):
    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tokenizer_fingerprint = tokenizer.fingerprint()
        tokenizer.surely_longer_than("", 0)  # computes its bound now, not in a request
        self.cluster = ClusterView(cfg.heartbeat_timeout)
        self.table = RequestTable()
        self.index = PrefixIndex()  # which prefix blocks each node holds
        self.policy = make_policy(
            cfg.scheduler, cfg.cost_profile, cfg.decode_placement, cfg.cost_time_scale
        )
        self.ctx = make_context(ClusterKey.load(cfg.cluster_key) if cfg.cluster_key else None)
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
        # an empty host tells each node to use the host it registered through (common/node/host.py)
        self.tokens_address = f"tcp://{cfg.advertise_host}:{cfg.tokens_port}"
        self.placer = Placer(
            self.cluster,
            self.table,
            self.policy,
            self._send_offer,
            self.index if cfg.cache_aware_routing == "on" else None,
            cfg.placement_timeout,
            cfg.offer_timeout,
            on_answer=self._count_answer,
            local=(
                LocalPrefill(parse_mode(cfg.local_prefill), self.policy.cost, cfg.tpot_slo)
                if cfg.local_prefill != "off"
                else None
            ),
            admission=Admission(
                cfg.admission,
                cfg.admission_max_wait or math.inf,
                cfg.admission_aging,
                cfg.ttft_slo or math.inf,
            ),
        )
        self.sizing = Sizing(self.policy.cost, cfg.sizing_window, tpot_slo=cfg.tpot_slo)
        self.metrics = GatewayMetrics(
            self.cluster, self.table, self.placer.waiting, self.desired_replicas
        )
        self.tasks: list[asyncio.Task] = []
        self.rebalanced_at: dict[str, float] = {}  # decode node id -> its last rebalance
        self.switcher = RoleSwitcher(cfg.switch_hold, cfg.switch_dwell)
        self.switching: dict[str, tuple[str, float]] = {}  # node id -> (new role, since)
        self.parser = ThreadPoolExecutor(2, thread_name_prefix="parse")  # tokenizing requests

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        loops: list[Coroutine[Any, Any, None]] = [
            self._control_loop(),
            self._tokens_loop(),
            self._liveness_loop(),
        ]
        if self.cfg.cluster_key:  # peers refused by CurveZMQ show only in the socket monitor
            loops += [
                watch_handshakes(self.control, "gateway.control"),
                watch_handshakes(self.tokens, "gateway.tokens"),
            ]
        self.tasks = [asyncio.create_task(c) for c in loops]

    async def stop(self) -> None:
        await self.placer.stop()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for attempt in self.table:
            attempt.req.finish(Failed(503, "the gateway is shutting down", "service_unavailable"))
        self.parser.shutdown(wait=False, cancel_futures=True)
        self.control.close()
        self.tokens.close()
        close_context(self.ctx)

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
        self.sizing.arrived(len(req.prompt_ids), time.monotonic(), req.params.max_tokens)
        if len(self.placer.waiting) >= self.cfg.max_waiting:  # bounded, whatever the load
            req.finish(
                Failed(
                    429,
                    f"{len(self.placer.waiting)} requests are waiting for a prefill node "
                    f"(--max-waiting); retry later",
                    "rate_limit_exceeded",
                    retry_after=max(1.0, self.placer.queued_seconds()),
                )
            )
            self.metrics.requests.labels("overloaded").inc()
            return
        if self.cfg.reject_ttft and (wait := self._overloaded(req)) is not None:
            req.finish(
                Failed(
                    503,
                    f"overloaded: the predicted time to first token exceeds "
                    f"{self.cfg.reject_ttft:g} s; retry later",
                    "service_unavailable",
                    retry_after=wait,
                )
            )
            self.metrics.requests.labels("overloaded").inc()
            return
        await self._place(req, req.prompt_ids, req.params)

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

    def abort(self, req: GatewayRequest, reason: str = "client disconnected") -> None:
        """Free the request everywhere (client gone, stop string matched, error)."""
        if not req.finished:
            req.finish(Failed(499, reason, "cancelled"))
            self.metrics.requests.labels("cancelled").inc()
        self._release(req, notify=True)

    def _release(self, req: GatewayRequest, notify: bool) -> None:
        attempt = self.table.current(req)
        if attempt is None:
            return
        self.table.close(attempt.wire_id)
        if notify:
            for node_id in attempt.nodes():
                node = self.cluster.nodes.get(node_id)
                if node is not None:
                    self._spawn(self._send_node(node, Abort(request_id=attempt.wire_id)))
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
            if (attempt := self.table.current(req)) is not None:
                self._spawn(self.replace(attempt, f"token stream broken: {gap}"))
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

    async def replace(self, attempt: Attempt, reason: str, kind: str = "lost") -> None:
        """Re-place the request of `attempt` as a prefill of prompt + generated tokens on the
        same stream.

        kind "lost": a node died or failed; these count against `max_replacements`.
        kind "preempted" / "no_room": a decode node gave it back; the request makes progress
        as others finish, so these do not count.

        Triggers spawn this and several may name the same attempt (a refusal and a
        preemption, two NeedDecodes) before the first runs: only the first re-places it; the
        rest find a newer attempt (or none) and do nothing. Two placements of one request
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
        await self._place(req, prompt, params)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_log_failure)

    # -- to nodes --------------------------------------------------------------------------
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

    # -- liveness --------------------------------------------------------------------------
    async def _liveness_loop(self) -> None:
        tick = min(0.25, self.cfg.heartbeat_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            if late > tick:
                # this process did not run (starved of CPU, a GC or swap pause): the nodes'
                # heartbeats wait unread in the socket, so the silence is ours, not theirs.
                # Dropping every node for it would fail every request in flight.
                level = logging.WARNING if late > self.cfg.heartbeat_timeout / 2 else logging.DEBUG
                log.log(level, "gateway stalled %.1f s; node leases extended by as much", late)
                self.cluster.excuse(late)
            for node_id in self.cluster.expired(now):
                await self._drop_node(node_id, "heartbeat timeout")
            for node in list(self.cluster.nodes.values()):
                # the progress lease: a node that heartbeats but holds work and produces no
                # token (a hung engine) is as good as dead: its requests go elsewhere
                since = self.table.work_since(node.node_id)
                if since is not None and now - max(since, node.progress_at) > (
                    limit := self.cfg.progress_timeout
                ):
                    await self._drop_node(node.node_id, f"no token in {limit:g} s while busy")
            for attempt in self.table:
                req = attempt.req
                # a token that waits this long for an earlier one waits for a lost message:
                # the attempt is broken, never shown as text with a hole in it
                if req.gap_since is not None and now - req.gap_since > self.cfg.stream_gap_timeout:
                    req.gap_since = None
                    why = f"token {len(req.output_ids)} never arrived"
                    self._spawn(self.replace(attempt, why))
            if self.cfg.rebalance:
                await self._rebalance(now)
            if self.cfg.role_switching == "on":
                await self._switch_roles(now)

    async def _drop_node(self, node_id: str, why: str) -> None:
        node = self.cluster.remove(node_id)
        self.index.drop(node_id)
        if node is None:
            return
        log.warning("dropped node %s: %s", node_id, why)
        for attempt in self.table.on_node(node_id):
            self._spawn(self.replace(attempt, f"{node.info.role} node {node_id}: {why}"))
        self.placer.capacity_changed()


def _bind_host(host: str) -> str:
    return "*" if host in ("0.0.0.0", "") else host


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
