"""Pool care (gateway/pools.py) from the liveness tick (gateway/liveness.py): never decided
on a view older than the gateway's own stall or than the nodes' heartbeats; and its records
of nodes and gateways, which churn (pods with new names, gateways restarted under new ids)
must not grow for good."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdserve.common.config import GatewayConfig
from pdserve.common.costmodel import CostModel
from pdserve.common.wire.protocol import GatewayLoad, Load, Rebalance, SwitchRole
from pdserve.gateway import pools as pools_module
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.liveness import Liveness
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.others import FORGET_S, OtherGateways
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.rebalance import COOLDOWN
from pdserve.gateway.roles import RoleSwitcher
from pdserve.gateway.sizing import Sizing
from pdserve.gateway.table import RequestTable
from tests.unit.test_policies import make_info
from tests.unit.test_rebalance import _Link, _running
from tests.unit.test_roles import SHORT_PREFILL, _cluster


class _Gateway:
    """A leader's cluster view, request table, pool care and liveness tick; no sockets:
    what it sends is in `link.sent`, and the nodes' reports are read when a test says."""

    def __init__(self, cfg: GatewayConfig, nodes: dict[str, str], at: float) -> None:
        self.cluster, self.table = ClusterView(cfg.heartbeat_timeout), RequestTable()
        self.link = _Link()
        for node_id, role in nodes.items():
            self.cluster.register(make_info(node_id, role=role), node_id.encode(), at, "t")
        unused: Any = None
        link: Any = self.link
        placer: Any = SimpleNamespace(waiting={})  # nothing waits for a prefill node
        sizing = Sizing(CostModel.named("h100-llama3.1-8b"), cfg.sizing_window)
        metrics = GatewayMetrics(self.cluster, self.table, {})
        self.pools = PoolCare(cfg, self.cluster, self.table, placer, sizing, metrics, link)
        self.liveness = Liveness(cfg, self.cluster, self.table, PrefixIndex(), unused, unused,
                                 self.pools)  # fmt: skip

    def read(self, loads: dict[str, Load], now: float) -> None:
        """The nodes' heartbeats, read at `now`."""
        for node_id, load in loads.items():
            assert self.cluster.heartbeat(node_id, node_id.encode(), load, now)

    async def tick(self, now: float, late: float = 0.0) -> list[tuple[bytes, object]]:
        """One liveness tick (`late`: how much later than its period it ran); what it sent."""
        await self.liveness._tick(now, late, 0.25)
        sent, self.link.sent = self.link.sent, []
        return sent


def _decode(free: int, held: tuple[str, ...] = ()) -> Load:
    return Load(running=len(held), waiting=0, blocks_free=free, blocks_cached=0,
                blocks_in_use=100 - free, held=held)  # fmt: skip


def _full_and_empty(gw: _Gateway, node: str = "A", other: str = "B") -> dict[str, Load]:
    """Six sequences decoding on `node`, 95 % full; `other` 5 %."""
    for i in range(6):
        _running(gw.table, node, f"{node}{i}", 32, 500)
    held = tuple(a.wire_id for a in gw.table.headed_to(node))
    return {node: _decode(5, held), other: _decode(95)}


async def test_a_leader_woken_from_a_stall_rebalances_only_on_reports_read_since():
    """Paused 5 s (SIGSTOP, a GC or swap stall), the leader ran a tick at once and moved
    sequences off a node by its report from before the pause: what the nodes said meanwhile
    waited unread in its socket."""
    gw = _Gateway(GatewayConfig(rebalance=0.9), {"A": "decode", "B": "decode"}, 100.0)
    full = _full_and_empty(gw)
    gw.read(full, 100.0)
    assert await gw.tick(105.0, late=4.75) == []  # the tick that finds the stall
    assert await gw.tick(105.25) == []  # nothing read since
    gw.read({"A": _decode(60, full["A"].held), "B": full["B"]}, 105.3)
    assert await gw.tick(105.5) == []  # the fresh view: A at 40 %, nothing to move
    gw.read(full, 105.8)
    ((to, order),) = await gw.tick(106.0)  # full again, and so reported
    assert to == b"A" and isinstance(order, Rebalance) and len(order.request_ids) == 4


async def test_pool_care_waits_for_a_node_whose_report_is_older_than_half_the_lease():
    gw = _Gateway(GatewayConfig(rebalance=0.9), {"A": "decode", "B": "decode"}, 100.0)
    full = _full_and_empty(gw)
    gw.read(full, 100.0)
    gw.read({"A": full["A"]}, 100.9)  # B silent since 100.0: 1.2 s at the tick
    assert await gw.tick(101.2) == []
    gw.read({"B": full["B"]}, 101.3)
    ((to, order),) = await gw.tick(101.4)
    assert to == b"A" and isinstance(order, Rebalance)


async def test_a_node_beating_late_within_its_own_gap_holds_nothing_back():
    """--heartbeat-timeout 1 and beats every 0.5 s: half the timeout is one beat, so any
    jitter on any node held every decision back. A node's own observed gap counts."""
    cfg = GatewayConfig(rebalance=0.9, heartbeat_timeout=1.0)
    gw = _Gateway(cfg, {"A": "decode", "B": "decode"}, 100.0)
    full = _full_and_empty(gw)
    for t in (100.0, 100.5, 101.0):
        gw.read(full, t)
    gw.read({"A": full["A"]}, 101.5)  # B's beat late: 0.7 s old at the tick
    ((to, order),) = await gw.tick(101.7)
    assert to == b"A" and isinstance(order, Rebalance)


async def test_a_leader_woken_from_a_stall_switches_the_donor_its_fresh_view_shows():
    """The imbalance held from before the pause; the stale view named d1 the least busy
    decode node (3 sequences), but by the time the leader ran again d1 ran 9 and d0 one.
    Nor did the hold run through the pause: it switched on the first sample after it."""
    cfg = GatewayConfig(role_switching="on", switch_hold=5.0, switch_dwell=0.0)
    gw = _Gateway(cfg, {"p0": "prefill", "d0": "decode", "d1": "decode"}, 100.0)
    gw.pools.desired_replicas = lambda now: SHORT_PREFILL  # type: ignore[method-assign]

    def loads(d0: int, d1: int) -> dict[str, Load]:
        empty = Load(running=0, waiting=0, blocks_free=100, blocks_cached=0, blocks_in_use=0)
        return {"p0": empty, "d0": _decode(50, ("x",) * d0), "d1": _decode(50, ("x",) * d1)}

    for i in range(10):  # short of prefill from 100.1 on, within the 5 s hold
        gw.read(loads(7, 3), 100.0 + i / 2)
        assert await gw.tick(100.1 + i / 2) == []
    assert await gw.tick(110.0, late=5.15) == []  # stalled: the hold would be over
    got: list = []
    for i in range(11):  # the hold starts over on the fresh view (one sample is no hold)
        gw.read(loads(1, 9), 110.2 + i / 2)
        got = await gw.tick(110.3 + i / 2)
        assert got == [] or i == 10
    assert got == [(b"d0", SwitchRole(role="prefill"))]


def _idle(token_cost: float = 0.0) -> Load:
    return Load(running=0, waiting=0, blocks_free=100, blocks_cached=0, blocks_in_use=0,
                token_cost=token_cost)  # fmt: skip


async def test_a_leader_woken_from_a_stall_exports_the_signal_it_decided_before(monkeypatch):
    """Paused 5 s (SIGSTOP, a GC pause), the leader's scrape computed the signal at once, from
    rates that saw no arrival meanwhile (the requests waited unread in its socket, as did
    the nodes' reports): 4,000-token prompts arriving for four prefill nodes read as load
    for one, and an autoscaler scaled the pool down for a load that never left. The signal
    keeps the value last decided on a fresh view until the view is fresh again."""
    clock = SimpleNamespace(now=0.0)  # the scrape's clock: the ticks' `now`
    monkeypatch.setattr(pools_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    gw = _Gateway(GatewayConfig(sizing_window=1.0), {"p0": "prefill", "d0": "decode"}, 100.0)
    loads = {"p0": _idle(token_cost=4e-5), "d0": _decode(100)}
    for i in range(50):  # a prompt every 40 ms for 2 s
        gw.pools.sizing.arrived(4000, 100.0 + 0.04 * i)
    gw.read(loads, 102.0)
    clock.now = 102.1
    assert await gw.tick(102.1) == []
    decided = gw.pools.published_replicas()
    assert decided["prefill"] >= 4, decided
    clock.now = 107.1  # the scrape first, then the tick that finds the stall
    assert gw.pools.published_replicas() == decided
    assert await gw.tick(107.1, late=4.75) == []
    assert gw.pools.published_replicas() == decided  # nothing read since the stall
    gw.pools.sizing.arrived(4000, 107.15)  # what waited unread: the load goes on
    gw.read(loads, 107.2)
    clock.now = 107.35
    assert await gw.tick(107.35) == []
    assert gw.pools.published_replicas() == gw.pools.desired_replicas(107.35)


async def test_a_gateway_exports_no_signal_until_it_decides_one_on_a_fresh_view():
    """A leader just started, or one that leads again: nothing it sized before (or for
    nodes it has not heard from) reaches the autoscaler."""
    gw = _Gateway(GatewayConfig(), {"p0": "prefill", "d0": "decode"}, 100.0)
    assert await gw.tick(100.25) == [] and gw.pools.published_replicas() == {}  # no report
    gw.read({"p0": _idle(), "d0": _decode(100)}, 100.3)
    assert await gw.tick(100.5) == []
    assert gw.pools.published_replicas() == {"prefill": 1, "decode": 1}
    led = _idle()
    gw.cluster.heartbeat("p0", b"p0", led, 100.6, leader="another")
    assert await gw.tick(100.75) == [] and gw.pools.published_replicas() == {}
    gw.cluster.heartbeat("p0", b"p0", led, 100.8)  # it names no other any more
    assert gw.pools.published_replicas() == {}  # not the value from before it lost the lead
    assert await gw.tick(101.0) == []
    assert gw.pools.published_replicas() == {"prefill": 1, "decode": 1}


def test_registrations_are_forgotten_once_past_the_dwell_which_still_holds():
    rules = RoleSwitcher(hold=0.0, dwell=30.0, cooldown=0.0)
    for i in range(1000):  # pods of new names, one a second
        rules.registered(f"decode-{i}", float(i))
    assert len(rules.registered_at) <= 31
    cluster = _cluster()  # d0 and d1, registered again at 1000 s
    rules.registered("d0", 1000.0)
    rules.registered("d1", 1000.0)
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 1029.0) is None  # dwell
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 1030.0) is not None


async def test_rebalance_rounds_of_nodes_come_and_gone_are_forgotten():
    gw = _Gateway(GatewayConfig(rebalance=0.9), {}, 0.0)
    assert COOLDOWN < 3.0
    for i in range(20):  # a new pair of decode nodes every 3 s, the old pair gone
        now = 3.0 * (i + 1)
        for node in list(gw.cluster.nodes):
            gw.cluster.remove(node)
        for node in (f"A{i}", f"B{i}"):
            gw.cluster.register(make_info(node, role="decode"), node.encode(), now, "t")
        gw.read(_full_and_empty(gw, f"A{i}", f"B{i}"), now)
        assert [to for to, _ in await gw.tick(now + 0.1)] == [f"A{i}".encode()]
    assert list(gw.pools.rebalanced_at) == ["A19"]  # the others' cooldowns are over


def test_gateways_no_node_relays_any_more_are_forgotten_without_a_scrape():
    """A gateway that does not lead is never asked for the others' backlog: each gateway
    restarted (under a new id) stayed in its records for good."""
    others = OtherGateways(lambda: "a", Sizing(CostModel.named("h100-llama3.1-8b")))
    for i in range(100):  # a gateway restarted every 10 s
        others.relayed((GatewayLoad(gateway=f"g{i}", seq=1, waiting_tokens=10),), 10.0 * i)
    assert len(others.seen) <= FORGET_S / 10 + 1


async def test_a_gateway_that_gains_the_lead_switches_no_node_for_a_cooldown(monkeypatch):
    """The last leader's switch may still be under way, its node between roles and seen by no
    gateway (so not busy): a lead gained waits a cooldown before its first switch, however
    long the imbalance has held."""
    cfg = GatewayConfig(role_switching="on", switch_hold=1.0, switch_dwell=0.0)
    gw = _Gateway(cfg, {"p0": "prefill", "d0": "decode", "d1": "decode"}, 100.0)
    gw.pools.desired_replicas = lambda now: SHORT_PREFILL  # type: ignore[method-assign]
    cooldown = gw.pools.switcher.cooldown
    leads = {"now": False}
    monkeypatch.setattr(gw.pools, "leading", lambda: leads["now"])
    empty = Load(running=0, waiting=0, blocks_free=100, blocks_cached=0, blocks_in_use=0)
    loads = {"p0": empty, "d0": _decode(50, ("x",)), "d1": _decode(50, ("x",) * 3)}
    gw.read(loads, 100.0)
    assert await gw.tick(100.1) == []  # another gateway leads
    leads["now"] = True  # the lead comes here (the last leader gone)
    got: list = []
    at = 100.2
    while not got and at < 100.1 + 2 * cooldown:
        gw.read(loads, at)
        got = await gw.tick(at + 0.05)
        at += 0.25
    assert got == [(b"d0", SwitchRole(role="prefill"))]
    assert at - 0.25 >= 100.1 + cooldown  # not before the cooldown from the lead's gain
