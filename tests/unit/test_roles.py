"""The role-switching rule (gateway/roles.py): when, which node, and never flapping; and
what pool care (gateway/pools.py) takes for a switch made elsewhere."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from msgspec.structs import replace

from pdserve.common.wire.protocol import Register
from pdserve.gateway.node_messages import NodeMessages
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.roles import RoleSwitcher
from pdserve.gateway.succession import Succession
from tests.unit.test_policies import cluster_with

SHORT_PREFILL = {"prefill": 2, "decode": 1}
BALANCED = {"prefill": 1, "decode": 2}


def _cluster():
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 50, "d1": 50})
    for name, running in (("d0", 7), ("d1", 3)):
        node = cluster.nodes[name]
        node.load = replace(node.load, running=running)
    return cluster


def test_a_steady_imbalance_switches_the_least_busy_donor_after_the_hold():
    rules = RoleSwitcher(hold=5.0, dwell=30.0, cooldown=10.0)
    cluster = _cluster()
    decisions = [rules.decide(cluster, SHORT_PREFILL, {}, False, 100.0 + t) for t in range(0, 10)]
    made = [(t, d) for t, d in enumerate(decisions) if d is not None]
    assert len(made) == 1 and made[0][0] == 5  # after 5 s of the same imbalance
    move = made[0][1]
    assert (move.node_id, move.role) == ("d1", "prefill")  # 3 running sequences, not 7
    assert "prefill wants 2 nodes, has 1" in move.why


def test_an_oscillating_load_switches_nothing():
    rules = RoleSwitcher(hold=5.0, dwell=0.0, cooldown=0.0)
    cluster = _cluster()
    for t in range(120):  # short of prefill for 4 s, then balanced for 4 s, and again
        desired = SHORT_PREFILL if (t // 4) % 2 == 0 else BALANCED
        assert rules.decide(cluster, desired, {}, False, float(t)) is None


def test_dwell_cooldown_a_switch_in_flight_and_the_last_node_of_a_pool_hold_it_back():
    cluster = _cluster()
    rules = RoleSwitcher(hold=0.0, dwell=30.0, cooldown=10.0)
    rules.registered("d0", 95.0)
    rules.registered("d1", 95.0)
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 100.0) is None  # 5 s in its role
    assert rules.decide(cluster, SHORT_PREFILL, {}, True, 130.0) is None  # one in flight
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 130.0) is not None
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 135.0) is None  # cooldown
    # the decode pool cannot give its only node, whatever prefill wants
    lone = cluster_with({"p0": (0, 0)}, {"d0": 50})
    assert (
        RoleSwitcher(hold=0.0, dwell=0.0).decide(lone, {"prefill": 9, "decode": 1}, {}, False, 1.0)
        is None
    )


def test_toward_decode_takes_the_prefill_node_with_fewest_prompts_in_prefill():
    cluster = cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 50})
    rules = RoleSwitcher(hold=0.0, dwell=0.0, cooldown=0.0)
    move = rules.decide(cluster, {"prefill": 1, "decode": 2}, {"p0": 1, "p1": 4}, False, 1.0)
    assert move is not None and (move.node_id, move.role) == ("p0", "decode")


def _pools(cluster, leads: bool = True) -> PoolCare:
    pools = PoolCare.__new__(PoolCare)
    pools.cluster, pools.switching, pools.switched_from = cluster, {}, {}
    pools.switcher = RoleSwitcher(hold=5.0, dwell=0.0, cooldown=0.0)
    pools.cfg = SimpleNamespace(rebalance=0.0, role_switching="on")  # type: ignore[assignment]
    pools.leading = lambda: leads  # type: ignore[method-assign]
    return pools


def test_a_node_of_the_other_role_under_a_live_id_is_a_switch_only_if_the_old_one_drains():
    """Another gateway ordered the switch (this one may not know): the old self drains first.
    A live, serving process of the other role under the id is a twin: dropping the old one
    for it, then it for the old one at its next registration, looped every heartbeat."""
    cluster = _cluster()
    pools = _pools(cluster)
    as_prefill = replace(cluster.nodes["d0"].info, role="prefill")
    assert not pools.switched_away(as_prefill, b"d0/twin")
    old = cluster.nodes["d0"]
    old.load = replace(old.load, draining=True)
    assert pools.switched_away(as_prefill, b"d0/switched")
    assert not pools.switched_away(as_prefill, old.identity)  # the same process again


def test_a_lead_lost_and_regained_starts_the_hold_afresh():
    cluster = _cluster()
    pools = _pools(cluster)
    assert pools.switcher.decide(cluster, SHORT_PREFILL, {}, False, 100.0) is None  # from 100
    pools.leading = lambda: False  # type: ignore[method-assign]
    asyncio.run(pools.tick(101.0, 0.0))  # another gateway leads for a while
    assert pools.switcher.decide(cluster, SHORT_PREFILL, {}, False, 300.0) is None  # afresh
    assert pools.switcher.decide(cluster, SHORT_PREFILL, {}, False, 305.0) is not None


def test_a_node_whose_switch_failed_is_not_the_donor_again_until_its_backoff_ends():
    """Its new role could not start: its supervisor restarts it in the old one, idle, the
    first donor again. It was asked again every dwell (drain, crash, reload) for good."""
    rules = RoleSwitcher(hold=0.0, dwell=30.0, cooldown=0.0)
    cluster = _cluster()  # d1 the least busy decode node
    rules.failed("d1", 100.0)  # back in its old role at 100 s: 2 dwells' backoff
    move = rules.decide(cluster, SHORT_PREFILL, {}, False, 101.0)
    assert move is not None and move.node_id == "d0"  # the other donor meanwhile
    rules.failed("d0", 101.0)
    assert rules.decide(cluster, SHORT_PREFILL, {}, False, 159.0) is None  # neither yet
    again = rules.decide(cluster, SHORT_PREFILL, {}, False, 161.0)
    assert again is not None and again.node_id == "d1"
    rules.failed("d1", 161.0)  # a second failure in a row: 4 dwells
    assert rules.failures["d1"] == (2, 161.0 + 120.0)
    rules.registered("d1", 300.0, switched=True)  # a switch that worked clears it
    assert "d1" not in rules.failures


def test_pool_care_counts_a_node_back_in_its_old_role_as_a_failed_switch():
    cluster = _cluster()
    pools = _pools(cluster)
    pools.switching["d1"] = ("prefill", 100.0)
    pools.switched_from["d1"] = cluster.nodes["d1"].identity
    pools.gone_since = {}
    pools.registered(cluster.nodes["d1"].info, cluster.nodes["d1"].identity, 110.0)
    assert "d1" in pools.switching  # the same process again (a lost answer): still switching
    pools.registered(cluster.nodes["d1"].info, b"d1/restarted", 140.0)  # as a decode node
    assert "d1" not in pools.switching and pools.switcher.failures["d1"][0] == 1
    pools.switching["d0"] = ("prefill", 150.0)
    pools.registered(replace(cluster.nodes["d0"].info, role="prefill"), b"d0/new", 160.0)
    assert "d0" not in pools.switcher.failures  # switched


def _messages(cluster, pools: PoolCare) -> NodeMessages:
    """A gateway's node messages as far as a Register goes; the answer is not kept."""

    async def reply(identity: bytes, msg: object) -> None:
        pass

    messages = NodeMessages.__new__(NodeMessages)
    messages.cluster, messages.pools, messages.tokenizer_fingerprint = cluster, pools, "t"
    messages.succession = Succession(cluster)
    none: Any = SimpleNamespace(drop=lambda node_id: None, queueing=False,
                                capacity_changed=lambda: None)  # fmt: skip
    messages.index, messages.policy, messages.placer = none, none, none
    link: Any = SimpleNamespace(reply=reply, tokens_address="t", gateway_id="g")
    messages.link = link
    return messages


def test_a_node_registering_again_from_the_same_process_keeps_its_dwell():
    """Dropped for a late heartbeat, or registering with a restarted gateway, a node's
    process says how long it has served its role (`Register.served_s`): its dwell runs on.
    It began anew at each repeat, so a node that registered again often was never a donor;
    a new process under the id (a restart, saying 0) starts it anew."""
    cluster = _cluster()  # d0 runs 7 sequences, d1 3
    pools = _pools(cluster)
    pools.switcher, pools.gone_since = RoleSwitcher(hold=0.0, dwell=30.0, cooldown=0.0), {}
    d0, d1 = cluster.nodes["d0"], cluster.nodes["d1"]
    now = time.monotonic()  # the gateway's clock, as its Register handler reads it
    pools.registered(d1.info, b"d1/restarted", now)
    asyncio.run(_messages(cluster, pools)._on_register(
        d0.identity, Register(info=d0.info, served_s=40.0)))  # fmt: skip
    move = pools.switcher.decide(cluster, SHORT_PREFILL, {}, False, time.monotonic())
    assert move is not None and move.node_id == "d0"  # d1 within its dwell
    rules = RoleSwitcher(hold=0.0, dwell=30.0)
    rules.registered("d0", 100.0)
    rules.registered("d0", 110.0, served=10.0)  # the same process, 10 s on
    assert rules.registered_at["d0"] == 100.0
    for unsaid in (float("nan"), float("inf"), -5.0):  # not a duration: from now
        rules.registered("d1", 120.0, served=unsaid)
        assert rules.registered_at["d1"] == 120.0
