"""The gateway, composed: who holds what, built in one place.

    NodeLink        the sockets to the nodes (gateway/link.py)
    RequestService  what the HTTP layer talks to: run, end and abort requests, tokens in,
                    re-placement (gateway/service.py)
    Placer          the offer protocol over the request table (gateway/placement.py)
    NodeMessages    one handler per node message (gateway/node_messages.py)
    Liveness        dead, hung and stuck nodes and streams (gateway/liveness.py)
    PoolCare        autoscaling signal, role switching, rebalancing (gateway/pools.py)

A request's way: HTTP handler -> RequestService.run -> Placer.place (offers until a prefill
node accepts) -> tokens through NodeMessages -> RequestService.on_token -> the request's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.common.config import GatewayConfig
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.wire.security import watch_handshakes
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.link import NodeLink
from pdserve.gateway.liveness import Liveness
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.node_messages import NodeMessages
from pdserve.gateway.placement import Admission, Placer
from pdserve.gateway.policies import Policy, make_policy
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.selective import LocalPrefill, parse_mode
from pdserve.gateway.service import RequestService
from pdserve.gateway.sizing import Sizing
from pdserve.gateway.table import RequestTable


class Gateway:
    def __init__(self, cfg: GatewayConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        tokenizer.surely_longer_than("", 0)  # computes its bound now, not in a request
        self.cluster = ClusterView(cfg.heartbeat_timeout)
        self.table = RequestTable()
        self.index = PrefixIndex()  # which prefix blocks each node holds
        self.policy = make_policy(
            cfg.scheduler, cfg.cost_profile, cfg.decode_placement, cfg.cost_time_scale
        )
        self.link = NodeLink(cfg)
        self.placer = _placer(
            cfg, self.cluster, self.table, self.policy, self.index, self.link,
            lambda node, accepted: _count_answer(self.metrics, self.cluster, node, accepted),
        )  # fmt: skip
        self.metrics = GatewayMetrics(
            self.cluster, self.table, self.placer.waiting, lambda: self.pools.published_replicas()
        )
        sizing = Sizing(self.policy.cost, cfg.sizing_window, tpot_slo=cfg.tpot_slo)
        self.service = RequestService(cfg, tokenizer, self.cluster, self.table, self.placer,
                                      sizing, self.metrics, self.link)  # fmt: skip
        self.pools = PoolCare(cfg, self.cluster, self.table, self.placer, sizing, self.metrics,
                              self.link)  # fmt: skip
        self.liveness = Liveness(cfg, self.cluster, self.table, self.index, self.placer,
                                 self.service, self.pools)  # fmt: skip
        self.messages = NodeMessages(
            self.cluster, self.table, self.index, self.policy, self.placer, self.metrics,
            self.link, self.service, self.pools,
            lambda *why: self.liveness.drop(*why),  # looked up late: tests replace it
            tokenizer.fingerprint(),
        )  # fmt: skip
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        loops: list[Coroutine[Any, Any, None]] = [
            self.messages.control_loop(),
            self.messages.tokens_loop(),
            self.liveness.loop(),
        ]
        if self.cfg.cluster_key:  # peers refused by CurveZMQ show only in the socket monitor
            loops += [
                watch_handshakes(self.link.control.sock, "gateway.control"),
                watch_handshakes(self.link.tokens.sock, "gateway.tokens"),
            ]
        self.tasks = [asyncio.create_task(c) for c in loops]

    async def stop(self) -> None:
        await self.placer.stop()
        await self.service.resumes.stop()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.service.close()
        self.link.close()


def _placer(
    cfg: GatewayConfig,
    cluster: ClusterView,
    table: RequestTable,
    policy: Policy,
    index: PrefixIndex,
    link: NodeLink,
    on_answer: Callable[[NodeState, bool | None], None],
) -> Placer:
    local = None
    if cfg.local_prefill != "off":
        local = LocalPrefill(parse_mode(cfg.local_prefill), policy.cost, cfg.tpot_slo)
    admission = Admission(
        cfg.admission,
        cfg.admission_max_wait or math.inf,
        cfg.admission_aging,
        cfg.ttft_slo or math.inf,
    )
    return Placer(
        cluster, table, policy, link.offer,
        index if cfg.cache_aware_routing == "on" else None,
        cfg.placement_timeout, cfg.offer_timeout,
        on_answer=on_answer, local=local, admission=admission,
    )  # fmt: skip


def _count_answer(
    metrics: GatewayMetrics, cluster: ClusterView, node: NodeState, accepted: bool | None
) -> None:
    """A prefill node's answer to an offer, counted per node and on /metrics."""
    if not cluster.holds(node):
        return  # dropped meanwhile: a count now would bring its series back for good
    if accepted is None:
        metrics.offer_timeouts.labels(node.node_id).inc()
    elif accepted:
        cluster.accepted(node)
        metrics.accepts.labels(node.node_id).inc()
    else:
        node.rejects += 1
        metrics.rejects.labels(node.node_id).inc()
