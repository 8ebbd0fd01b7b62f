"""The autoscaling signal's rule (gateway/sizing.py) on loads with known answers."""

from __future__ import annotations

import math

import pytest
from msgspec.structs import replace

from pdserve.common.costmodel import CostModel
from pdserve.common.wire.protocol import Load
from pdserve.gateway.sizing import Ewma, Sizing
from tests.unit.test_policies import cluster_with

COST = CostModel.named("h100-llama3.1-8b")


def test_the_rate_estimate_converges_to_a_steady_rate_and_decays_after_it():
    ewma = Ewma(window=10.0)
    for i in range(2000):  # 5 events a second for 400 s
        ewma.add(1.0, i * 0.2)
    assert ewma.rate(400.0) == pytest.approx(5.0, rel=0.03)
    assert ewma.rate(400.0 + 30.0) == pytest.approx(5.0 * math.exp(-3), rel=0.03)


def test_prefill_replicas_are_the_offered_work_over_the_target_utilisation():
    sizing = Sizing(COST, window=10.0)
    prompt = 2000
    per_request = COST.prefill_seconds(prompt)
    rate = 3.0 / per_request  # three prefill nodes' worth of work, at 100 % busy
    t = 0.0
    while t < 200.0:
        sizing.arrived(prompt, t)
        t += 1 / rate
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 100})
    # 3 node-seconds a second / 0.8 -> 4 nodes
    assert sizing.prefill(cluster, backlog_tokens=0, now=t) == 4
    # a backlog of 20 s of one node's work, drained within one 10 s window: 2 more
    backlog = round(20 / per_request) * prompt
    assert sizing.prefill(cluster, backlog, now=t) == math.ceil((3 + 2) / 0.8 - 1e-9)
    assert Sizing(COST).prefill(cluster, 0, now=0.0) == 1  # no load: one


def test_another_gateway_s_backlog_alone_is_sized_at_a_full_pass_not_one_token():
    """No arrival here yet, no prefill node measured: the per-token cost was the model's
    for a 1-token prompt (a step's fixed cost every token), and 200k tokens waiting at
    another gateway asked for 38 prefill nodes."""
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 100})
    got = Sizing(COST, window=10.0).prefill(cluster, 200_000, now=100.0)
    full = cluster.nodes["p0"].info.max_batch_tokens  # the backlog as full passes (1000)
    per_token = COST.prefill_seconds(full) / full
    assert got == math.ceil(200_000 / 10.0 * per_token / 0.8 - 1e-9) < 5


def test_measured_token_cost_wins_over_the_cost_model():
    sizing = Sizing(COST, window=10.0)
    for i in range(1000):
        sizing.arrived(1000, i * 0.1)  # 10,000 tokens a second
    cluster = cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 100})
    for node in cluster.alive("prefill"):  # measured: 0.3 ms a token -> 3 node-seconds/s
        node.load = replace(node.load, token_cost=0.0003)
    assert sizing.prefill(cluster, 0, now=100.0) == math.ceil(3 / 0.8)


def test_decode_replicas_cover_the_kv_in_use_and_the_batch_the_tpot_slo_allows():
    cluster = cluster_with({}, {"d0": 0, "d1": 0})  # 100 blocks each
    for node in cluster.alive("decode"):
        node.load = Load(running=10, waiting=0, blocks_free=10, blocks_cached=0, blocks_in_use=90)
    # 180 blocks in use / (100 x 0.8) -> 3
    assert Sizing(COST).decode(cluster) == 3
    tight = Sizing(COST, tpot_slo=COST.decode_step_seconds([144] * 5))  # 5 fit at the SLO
    assert tight.batch_within_slo(144) == 5
    assert tight.decode(cluster) == 4  # 20 running, 5 per node
    assert Sizing(COST, tpot_slo=1e-6).batch_within_slo(144) == 1


def test_decode_replicas_move_with_the_arriving_load_before_the_batches_grow():
    """Little's law: 24 requests a second asking 1,000 tokens each, at a TPOT of 15 ms, build
    a batch of 360; the signal says so while the decode nodes are still empty."""
    sizing = Sizing(COST, window=2.0, tpot_slo=0.015)
    t = 0.0
    while t < 20.0:
        sizing.arrived(200, t, output_tokens=1000)
        t += 1 / 24
    cluster = cluster_with({}, {"d0": 100})  # nothing running there yet
    per_node = sizing.batch_within_slo(200 + 500)
    assert sizing.decode(cluster, now=t) == math.ceil(24 * 1000 * 0.015 / per_node - 1e-6)
    assert sizing.decode(cluster, now=t) >= 2
    assert sizing.decode(cluster, now=t + 60.0) == 1  # the load is gone: decayed


def test_the_cost_model_speaks_a_scaled_clock():
    slow = replace_cost(COST, 4.0)
    assert slow.decode_step_seconds([500] * 8) == pytest.approx(
        4 * COST.decode_step_seconds([500] * 8)
    )
    assert slow.transfer_seconds(4000) == pytest.approx(4 * COST.transfer_seconds(4000))
    # a TPOT SLO in the slow clock allows the same batch as the real one does in its own
    assert Sizing(slow, tpot_slo=0.06).batch_within_slo(700) == Sizing(
        COST, tpot_slo=0.015
    ).batch_within_slo(700)


def replace_cost(cost: CostModel, scale: float) -> CostModel:
    import dataclasses

    return dataclasses.replace(cost, time_scale=scale)


def test_the_leader_sizes_for_every_gateway_s_arrivals_as_the_nodes_relay_them():
    """Two gateways behind a balancer, each taking half the requests: the leader sized the
    prefill pool for its own half (4,000-token prompts at 3 nodes' worth: it asked for 2
    nodes where 4 are needed). With the other's arrivals relayed through the nodes' heartbeats
    (its counts as of each relay; a relay of older news among them), the leader's signal is
    the one a single gateway taking everything gives, and the other's waiting prompts count
    in its backlog until that gateway is no longer heard of."""
    from pdserve.common.wire.protocol import GatewayLoad
    from pdserve.gateway.others import FORGET_S, OtherGateways

    prompt = 4000
    rate = 3.0 / COST.prefill_seconds(prompt)
    whole, leader, other = (Sizing(COST, window=10.0) for _ in range(3))
    others = OtherGateways(lambda: "a", leader)
    t, i, reports = 0.0, 0, []
    while t < 200.0:
        whole.arrived(prompt, t)
        (leader if i % 2 == 0 else other).arrived(prompt, t)
        if i % 20 == 0:  # a node relays the other gateway's count now and then
            tokens, requests, outputs, _ = other.own
            reports.append(GatewayLoad(gateway="b", seq=len(reports) + 1, prompt_tokens=tokens,
                                       requests=requests, output_tokens=outputs,
                                       waiting_tokens=8000))  # fmt: skip
            # its own report is skipped; the one before the newest, relayed after it by
            # another node, is older news
            others.relayed((GatewayLoad(gateway="a", seq=10**9), *reports[-2:][::-1]), t)
        t, i = t + 1 / rate, i + 1
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 100})
    alone = Sizing(COST, window=10.0)
    for j in range(0, i, 2):  # what the leader saw of its own, alone
        alone.arrived(prompt, j / rate)
    assert alone.prefill(cluster, 0, now=t) < whole.prefill(cluster, 0, now=t) == 4
    assert leader.prefill(cluster, 0, now=t) == 4
    assert others.waiting_tokens(t) == 8000
    others.relayed((reports[-1],), t + FORGET_S)  # relayed again, but no newer report
    assert others.waiting_tokens(t + FORGET_S + 1) == 0  # gone: its backlog with it


def test_prompts_their_decode_nodes_prefill_are_no_demand_on_the_prefill_pool():
    """Selective disaggregation: every prompt counted as prefill-pool demand at arrival, so
    under `--local-prefill always` (the prefill pool idle) it was sized for all the work,
    and with --role-switching decode nodes were switched into that idle pool. Now what
    decode nodes prefilled themselves is theirs: here or relayed from another gateway."""
    from pdserve.common.wire.protocol import GatewayLoad
    from pdserve.gateway.others import OtherGateways
    from pdserve.gateway.roles import RoleSwitcher

    prompt = 2000
    rate = 3.0 / COST.prefill_seconds(prompt)  # three prefill nodes' worth of prompts
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 100, "d1": 100, "d2": 100})
    sizes = {}
    for share in (0.0, 0.5, 1.0):  # of the prompts prefilled locally
        sizing, t, i = Sizing(COST, window=10.0), 0.0, 0
        while t < 200.0:
            sizing.arrived(prompt, t)
            if i % 10 < share * 10:
                sizing.prefilled_locally(prompt, t)
            t, i = t + 1 / rate, i + 1
        sizes[share] = sizing.prefill(cluster, backlog_tokens=0, now=t)
    assert sizes == {0.0: 4, 0.5: 2, 1.0: 1}  # 3, 1.5, 0 node-seconds a second / 0.8
    # `always` with role switching: the decode pool keeps its nodes
    switcher = RoleSwitcher(hold=5.0, dwell=0.0, cooldown=0.0)
    desired = {"prefill": sizes[1.0], "decode": 1}
    assert all(switcher.decide(cluster, desired, {}, False, 300.0 + k) is None for k in range(20))
    # another gateway's local prefills, relayed by the nodes
    leader = Sizing(COST, window=10.0)
    others = OtherGateways(lambda: "a", leader)
    t, i = 0.0, 0
    while t < 200.0:
        i += 1
        said = GatewayLoad(gateway="b", seq=i, prompt_tokens=i * prompt, requests=i,
                           local_tokens=i * prompt)  # fmt: skip
        others.relayed((said,), t)
        t += 1 / rate
    assert leader.prefill(cluster, 0, now=t) == 1


def test_a_relayed_load_without_local_tokens_does_not_count_them_again():
    """A node of an older version relays a gateway's load without local_tokens (0): the next
    report of a newer node added that gateway's whole total of local tokens again."""
    from pdserve.common.wire.protocol import GatewayLoad
    from pdserve.gateway.others import OtherGateways

    got: list[int] = []

    class _Sizing:
        def add(self, tokens, requests, outputs, now, local=0) -> None:
            got.append(local)

    others = OtherGateways(lambda: "a", _Sizing())  # type: ignore[arg-type]
    for seq, local in ((1, 500), (2, 0), (3, 1000), (4, 0), (5, 1200)):  # new, old, new...
        load = GatewayLoad(gateway="b", seq=seq, prompt_tokens=100 * seq, local_tokens=local)
        others.relayed((load,), float(seq))
    assert sum(got) == 1200 - 500  # what grew since the first report, once


def test_relayed_counts_that_go_back_or_out_of_bounds_move_nothing():
    """Relayed loads are a node's word. A count that went back (an older version, a fault)
    fed the sizing a negative request count (that delta alone was not clamped) and set a
    lower base the next report counted the whole difference from again; a negative or
    unbounded backlog took the others' waiting prompts below zero or past any pool."""
    from pdserve.common.wire.protocol import GatewayLoad
    from pdserve.gateway.others import OtherGateways

    sizing = Sizing(COST, window=10.0)
    added: list[tuple] = []
    sizing.add = lambda *counts: added.append(counts)  # type: ignore[method-assign]
    others = OtherGateways(lambda: "a", sizing)

    def relay(seq: int, tokens: int, requests: int, t: float) -> None:
        load = GatewayLoad(gateway="b", seq=seq, prompt_tokens=tokens, requests=requests,
                           output_tokens=tokens // 10, local_tokens=tokens // 2)  # fmt: skip
        others.relayed((load,), t)

    relay(1, 1000, 10, 0.0)  # the base
    relay(2, 500, 4, 1.0)  # went back: nothing grew
    relay(3, 1100, 11, 2.0)  # grew by 100 tokens and one request since the highest
    assert added == [(0, 0, 0, 1.0, 0), (100, 1, 10, 2.0, 50)]
    for gateway, waiting in (("c", -5000), ("d", 1 << 60), ("e", 300)):
        others.relayed((GatewayLoad(gateway=gateway, seq=1, waiting_tokens=waiting),), 3.0)
    others.relayed((GatewayLoad(gateway="b", seq=4, prompt_tokens=-1),), 3.0)
    assert others.waiting_tokens(3.0) == 300 and others.seen["b"][0].seq == 3
