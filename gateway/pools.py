"""The gateway's care of the pools while it serves: the autoscaling signal each pool's size
is judged by (gateway/sizing.py), live role switching (gateway/roles.py) and decode
rebalancing (gateway/rebalance.py). The rules are pure and live in those modules; this
applies them, from the liveness loop's tick. With several gateways only the leader does (the
gateway every node names; the nodes obey no other: docs/architecture.md, "Several gateways").
"""

from __future__ import annotations

import logging
import time

import msgspec

from pdserve.common.config import GatewayConfig
from pdserve.common.wire.protocol import GatewayLoad, NodeInfo, Rebalance, SwitchRole
from pdserve.gateway import rebalance
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.link import NodeLink
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.others import OtherGateways
from pdserve.gateway.placement import Placer
from pdserve.gateway.plan import views
from pdserve.gateway.roles import RoleSwitcher
from pdserve.gateway.sizing import Sizing
from pdserve.gateway.table import RequestTable

log = logging.getLogger("pdserve.gateway.core")
SWITCH_GIVE_UP_S = 600.0  # a switching node not back in its new role by then is forgotten
SWITCH_GONE_S = 60.0  # a switching node gone this long (after its drain) died on the way


class PoolCare:
    def __init__(
        self,
        cfg: GatewayConfig,
        cluster: ClusterView,
        table: RequestTable,
        placer: Placer,
        sizing: Sizing,
        metrics: GatewayMetrics,
        link: NodeLink,
    ) -> None:
        self.cfg, self.cluster, self.table, self.placer = cfg, cluster, table, placer
        self.sizing, self.metrics, self.link = sizing, metrics, link
        self.switcher = RoleSwitcher(cfg.switch_hold, cfg.switch_dwell)
        self.switching: dict[str, tuple[str, float]] = {}  # node id -> (new role, since)
        self.switched_from: dict[str, bytes] = {}  # node id -> the process asked to switch
        self.gone_since: dict[str, float] = {}  # switching nodes not registered, since when
        self.rebalanced_at: dict[str, float] = {}  # decode node id -> its last rebalance
        self.planned = rebalance.Planned()  # where the moves go (NodeMessages asks)
        self.others = OtherGateways(lambda: link.gateway_id, sizing)
        self.said = GatewayLoad(gateway="")  # own_load's last, and when
        self.said_at = -1.0
        # the signal as last decided, on a fresh view (tick): what /metrics exports, so a
        # stall's stale reports never reach an autoscaler; {} until the first such decision
        self.decided: dict[str, int] = {}

    def own_load(self) -> GatewayLoad:
        """This gateway's arrivals and waiting prompts, for the others (gateway/others.py);
        taken at most every 0.25 s (every node's heartbeat reply carries it, and summing
        the waiting queue for each would cost most when the queue is longest)."""
        now = time.monotonic()
        if now - self.said_at >= 0.25:
            tokens, requests, outputs, local = self.sizing.own
            waiting, seq = self._waiting(), self.said.seq + 1
            self.said = GatewayLoad(gateway=self.link.gateway_id, seq=seq, prompt_tokens=tokens,
                                    requests=requests, output_tokens=outputs, local_tokens=local,
                                    waiting_tokens=waiting)  # fmt: skip
            self.said_at = now
        return self.said

    def _waiting(self) -> int:
        return sum(w.need.prompt_len for w in self.placer.waiting.values())

    def desired_replicas(self, now: float) -> dict[str, int]:
        """The autoscaling signal per pool (gateway/sizing.py): for every gateway's load (the
        others' as the nodes relay it)."""
        backlog = self._waiting() + self.others.waiting_tokens(now)
        return {
            "prefill": self.sizing.prefill(self.cluster, backlog, now),
            "decode": self.sizing.decode(self.cluster, now),
        }

    def leading(self) -> bool:
        """Several gateways: only the one the nodes name decides pool care."""
        return self.cluster.leads(self.link.gateway_id)

    def published_replicas(self) -> dict[str, int]:
        """/metrics: the leader's signal alone (the others export none), so an autoscaler
        never averages two gateways' decisions; as its last tick on a fresh view decided it
        (a scrape right after a stall, before the tick that finds it, reads that one too)."""
        return self.decided if self.leading() else {}

    async def tick(self, now: float, awake: float) -> None:
        """`awake`: when the gateway's last stall ended (gateway/liveness.py)."""
        if not self.leading():
            # a lead regained later starts its hold afresh: not from a sample taken before
            self.switcher.toward = self.switcher.since = None
            # and its first switch a cooldown after it: the last leader's switch may still be
            # under way, its node between roles and seen by no gateway (so not "busy")
            self.switcher.last_switch = now
            self.decided = {}  # nor exports a signal decided then
            return
        self._give_up_switches(now)
        # decided on a fresh view only: after a stall of this process (the tick that found it
        # set `awake` to its own time) the nodes' reports sent meanwhile wait unread in its
        # socket, and every one it holds is as old as the stall; nor on a node's report
        # older than its beat (ClusterView.fresh_view)
        if not self.cluster.fresh_view(awake, now):
            since = self.switcher.since
            if since is not None and awake > since:  # a hold does not run through a stall:
                self.switcher.toward = self.switcher.since = None  # one sample after it
            return  # would do otherwise; the signal keeps its last value meanwhile
        self.decided = self.desired_replicas(now)
        if self.cfg.rebalance:
            await self._rebalance(now)
        if self.cfg.role_switching == "on":
            await self._switch_roles(now)

    def switched_away(self, info: NodeInfo, identity: bytes) -> bool:
        """A node registers in the role it was asked to take, from a new socket, before its
        old self's Deregister arrived: that old self must be dropped first. With several
        gateways the leader asked (this gateway may not know): a node registering in the
        other role under its id from a new socket, its old self draining, is that node,
        switched. A live old self that is not draining is a twin's: judged as any process
        claiming a registered id (gateway/succession.py), not dropped at each of the two's
        registrations in turn."""
        switched = self.switching.get(info.node_id)
        old = self.cluster.nodes.get(info.node_id)
        if old is None or old.identity == identity:
            return False
        if switched is not None:
            return switched[0] == info.role
        return {old.info.role, info.role} == {"prefill", "decode"} and old.load.draining

    def registered(self, info: NodeInfo, identity: bytes, now: float, served: float = 0.0) -> None:
        """Back in its new role, or restarted in its old one: a switch is over (failed, in
        the second case: that node is not asked again at once). The process asked to switch
        registering again (it lost an answer) is no end of it. `served`: `Register.served_s`."""
        if info.node_id in self.switching and self.switched_from.get(info.node_id) == identity:
            return
        self.switched_from.pop(info.node_id, None)
        switch = self.switching.pop(info.node_id, None)
        self.gone_since.pop(info.node_id, None)
        if switch is not None and switch[0] != info.role:
            self.switcher.failed(info.node_id, now)
        switched = switch is not None and switch[0] == info.role
        self.switcher.registered(info.node_id, now, switched, served)

    async def switch_role(self, node_id: str, role: str, why: str) -> bool:
        """Ask a node to take the other role (gateway/roles.py; common/node/roles.py)."""
        node = self.cluster.nodes.get(node_id)
        if node is None or node.info.role == role or role not in ("prefill", "decode"):
            return False
        log.info("switching %s from %s to %s: %s", node_id, node.info.role, role, why)
        self.switching[node_id] = (role, time.monotonic())
        self.switched_from[node_id] = node.identity
        node.load = msgspec.structs.replace(node.load, draining=True)  # no new work meanwhile
        self.metrics.role_switches.labels(node.info.role, role).inc()
        await self.link.reply(node.identity, SwitchRole(role=role))  # type: ignore[arg-type]
        return True

    def _give_up_switches(self, now: float) -> None:
        """Switches not over in time, or whose node will not come back: forgotten (on a
        stale view too: this judges only this gateway's own records)."""
        for node_id, (_, since) in list(self.switching.items()):
            if now - since > SWITCH_GIVE_UP_S or self._will_not_switch(node_id, since, now):
                del self.switching[node_id]
                self.switched_from.pop(node_id, None)
                self.gone_since.pop(node_id, None)
                self.switcher.failed(node_id, now)

    async def _switch_roles(self, now: float) -> None:
        in_prefill = {n: len(self.table.in_prefill(n)) for n in self.cluster.nodes}
        # one switch at a time, also across a change of leader: a node draining may be one
        # another leader ordered (its switch is not in this one's table), or a scale-down
        busy = bool(self.switching) or any(n.load.draining for n in self.cluster.nodes.values())
        move = self.switcher.decide(self.cluster, self.decided, in_prefill, busy, now)
        if move is not None:
            await self.switch_role(move.node_id, move.role, move.why)

    def _will_not_switch(self, node_id: str, since: float, now: float) -> bool:
        """A switch that will not complete, so that it blocks the next one no longer: the
        node ignored the order (a report well after it says it serves on, not draining: it
        was draining already, or obeys another gateway), or it left and has not registered
        again in the time a restart takes (it died on the way, or exited from a drain)."""
        node = self.cluster.nodes.get(node_id)
        if node is None:
            return now - self.gone_since.setdefault(node_id, now) > SWITCH_GONE_S
        self.gone_since.pop(node_id, None)
        return node.load_at > since + self.cfg.heartbeat_timeout and not node.load.draining

    async def _rebalance(self, now: float) -> None:
        """Move running sequences off a decode node filling up (gateway/rebalance.py)."""
        pool = views(self.cluster, self.table, "decode")
        move = rebalance.choose(pool, self.table, self.cfg.rebalance, self.rebalanced_at, now)
        node = self.cluster.nodes.get(move.source) if move is not None else None
        if move is None or node is None:
            return
        # a round past the cooldown holds nothing back: forgotten, or node churn grows it
        self.rebalanced_at = {
            n: at for n, at in self.rebalanced_at.items() if now - at < rebalance.COOLDOWN
        }
        self.rebalanced_at[move.source] = now
        self.planned.remember(move, now)
        self.metrics.rebalances.inc(len(move.request_ids))
        log.info(
            "rebalancing: %d sequences %s -> %s", len(move.request_ids), move.source, move.target
        )
        await self.link.reply(node.identity, Rebalance(request_ids=move.request_ids))
