"""Which nodes are alive, judged on the gateway's own clock: a node silent past
`--heartbeat-timeout`, or holding work without producing a token past `--progress-timeout`,
is dropped and its requests re-placed; a token stream stuck behind a lost token, or a KV
hand-off that never completes, is re-placed.
The same tick drives the pools' care (gateway/pools.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.common.config import GatewayConfig
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.placement import Placer
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.service import RequestService
from pdserve.gateway.table import RequestTable

log = logging.getLogger("pdserve.gateway.core")


class Liveness:
    def __init__(
        self,
        cfg: GatewayConfig,
        cluster: ClusterView,
        table: RequestTable,
        index: PrefixIndex,
        placer: Placer,
        service: RequestService,
        pools: PoolCare,
    ) -> None:
        self.cfg, self.cluster, self.table, self.index = cfg, cluster, table, index
        self.placer, self.service, self.pools = placer, service, pools
        self.awake = 0.0  # when the gateway's last stall ended

    async def loop(self) -> None:
        tick = min(0.25, self.cfg.heartbeat_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            try:
                await self._tick(now, late, tick)
            except Exception:  # one bad tick must not end liveness: no node would expire again
                log.exception("liveness tick failed")

    async def _tick(self, now: float, late: float, tick: float) -> None:
        if late > tick:
            # this process did not run (starved of CPU, a GC or swap pause): the nodes'
            # heartbeats wait unread in the socket, so the silence is ours, not theirs.
            # Dropping every node for it would fail every request in flight.
            level = logging.WARNING if late > self.cfg.heartbeat_timeout / 2 else logging.DEBUG
            log.log(level, "gateway stalled %.1f s; node leases extended by as much", late)
            self.cluster.excuse(late)
            # what came meanwhile waits unread: no hand-off judged on it, no pool decision
            # made on the reports from before (gateway/pools.py)
            self.awake = now
        for node_id in self.cluster.expired(now):
            await self.drop(node_id, "heartbeat timeout")
        await self._check_progress(now)
        self._check_handoffs(now)
        self._check_streams(now)
        await self.pools.tick(now, self.awake)

    async def drop(self, node_id: str, why: str, kind: str = "lost") -> None:
        """`kind` "preempted": a node that left as planned (a drain, a role switch); what
        it still held does not count against the requests' `--max-replacements`."""
        node = self.cluster.remove(node_id)
        self.index.drop(node_id)
        if node is None:
            return
        self.service.metrics.forget_node(node_id)
        log.warning("dropped node %s: %s", node_id, why)
        for attempt in self.table.on_node(node_id):
            self.service.spawn(
                self.service.replace(attempt, f"{node.info.role} node {node_id}: {why}", kind)
            )
        self.placer.capacity_changed()

    async def _check_progress(self, now: float) -> None:
        """The progress lease: a node that heartbeats but holds work and produces no token
        (a hung engine) is as good as dead: its requests go elsewhere."""
        limit = self.cfg.progress_timeout
        for node in list(self.cluster.nodes.values()):
            since = self.table.work_since(node.node_id)
            if since is not None and now - max(since, node.progress_at) > limit:
                await self.drop(node.node_id, f"no token in {limit:g} s while busy")

    def _check_handoffs(self, now: float) -> None:
        """A request whose KV never reaches its decode node after its first token would
        wait forever, its blocks held on both nodes (the lease keeps what the table knows):
        placed again after the progress timeout, as a node that produced nothing would be."""
        limit = self.cfg.progress_timeout
        for attempt in self.table.stalled_handoffs(now, limit, self.awake):
            why = f"its KV did not reach {attempt.decode} in {limit:g} s"
            self.service.spawn(self.service.replace(attempt, why))

    def _check_streams(self, now: float) -> None:
        """A token that waits this long for an earlier one waits for a lost message: the
        attempt is broken, never shown as text with a hole in it."""
        for attempt in self.table:
            req = attempt.req
            if req.gap_since is not None and now - req.gap_since > self.cfg.stream_gap_timeout:
                req.gap_since = None
                why = f"token {len(req.output_ids)} never arrived"
                self.service.spawn(self.service.replace(attempt, why))
