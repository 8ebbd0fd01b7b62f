"""The selective-disaggregation rule (gateway/selective.py): which prompts a decode node
prefills itself, as the load moves the threshold."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from pdserve.common.costmodel import CostModel
from pdserve.gateway.plan import views
from pdserve.gateway.selective import LocalPrefill, parse_mode
from pdserve.gateway.table import RequestTable
from tests.unit.test_policies import cluster_with

COST = CostModel.named("h100-llama3.1-8b")


def _cluster(running: int = 8, in_use: int = 40):
    cluster = cluster_with({"p0": (0, 0)}, {"d0": 60})
    node = cluster.nodes["d0"]
    node.load = replace(node.load, running=running, blocks_in_use=in_use)
    return cluster


def _pools(running: int = 8, in_use: int = 40):
    cluster, table = _cluster(running, in_use), RequestTable()
    return views(cluster, table, "decode")[0], views(cluster, table, "prefill")


def test_an_idle_prefill_pool_keeps_only_prompts_no_longer_than_a_decode_step():
    rule = LocalPrefill("adaptive", COST)
    decode, prefill = _pools()
    step = COST.decode_step_seconds([40 * 16 // 8] * 8)
    short = next(n for n in range(1, 4000) if COST.prefill_seconds(n + 1) > step)
    made = rule.decide(short, COST.prefill_seconds(short), decode, prefill, 0.0)
    assert made.local and made.step_s == pytest.approx(step)
    long = rule.decide(2000, COST.prefill_seconds(2000), decode, prefill, 0.0)
    assert not long.local and long.threshold_s == pytest.approx(step)  # max(S, 0 + X) = S


def test_a_backed_up_prefill_pool_raises_the_threshold_up_to_the_stall_budget():
    rule = LocalPrefill("adaptive", COST)
    decode, prefill = _pools()
    p = COST.prefill_seconds(1000)
    assert not rule.decide(1000, p, decode, prefill, queued_s=0.0).local
    made = rule.decide(1000, p, decode, prefill, queued_s=p)  # a wait as long as it
    step = made.step_s
    assert made.threshold_s == pytest.approx(min(4 * step, p + COST.transfer_seconds(1000)))
    assert made.local == (p <= made.threshold_s)
    huge = rule.decide(30000, COST.prefill_seconds(30000), decode, prefill, queued_s=60.0)
    assert not huge.local and huge.threshold_s == pytest.approx(4 * step)  # the budget caps it
    strict = LocalPrefill("adaptive", COST, tpot_slo=0.02)
    capped = strict.decide(30000, COST.prefill_seconds(30000), decode, prefill, queued_s=60.0)
    assert capped.threshold_s == pytest.approx(0.04)  # twice the TPOT SLO


def test_fixed_always_and_the_modes_parsing():
    decode, prefill = _pools()
    assert LocalPrefill(512, COST).decide(512, 0.1, decode, prefill, 9.0).local
    assert not LocalPrefill(512, COST).decide(513, 0.0, decode, prefill, 0.0).local
    assert LocalPrefill("always", COST).decide(99999, 9.0, decode, prefill, 0.0).local
    assert parse_mode("adaptive") == "adaptive" and parse_mode("256") == 256
    with pytest.raises(ValueError):
        parse_mode("sometimes")


def test_the_local_rule_counts_what_the_decode_node_itself_lacks():
    """The rule was given the prompt less the best holder's blocks anywhere in the cluster,
    but a decode node prefilling locally fetches nothing: 1,000 tokens of which 960 sat on a
    prefill node counted as 40 (local under `64`), and the decode node computed all 1,000,
    stalling its streams. Now what it holds itself counts."""
    from types import SimpleNamespace

    from pdserve.common.wire.protocol import KvEvents
    from pdserve.gateway.placement import Placer
    from pdserve.gateway.plan import Snapshot
    from pdserve.gateway.policies import Need, make_policy
    from pdserve.gateway.prefix_index import PrefixIndex

    cluster, table, index = cluster_with({"p0": (0, 0)}, {"d0": 100}), RequestTable(), PrefixIndex()
    hashes = tuple(bytes([i]) * 8 for i in range(62))  # 62 blocks of 16
    index.apply(KvEvents(node_id="p0", seq=0, stored=list(hashes[:60]), snapshot=True))
    placer = Placer(cluster, table, make_policy("on_demand"), send_offer=None,  # type: ignore[arg-type]
                    index=index, placement_timeout=1.0, offer_timeout=1.0,
                    local=LocalPrefill(parse_mode("64"), COST))  # fmt: skip
    need = Need(1000, hashes=hashes)
    assert placer.uncached(need) == 1000 - 60 * 16  # for the prefill pool: fetched or there
    waiting = SimpleNamespace(need=need, req=SimpleNamespace(timeline={}, attempt=0))
    pairs = placer._local_first(waiting, [], Snapshot(cluster, table, index))  # type: ignore[arg-type]
    assert pairs == [] and not waiting.req.timeline["local_prefill.0"]["local"]
    index.apply(KvEvents(node_id="d0", seq=0, stored=list(hashes[:60]), snapshot=True))
    pairs = placer._local_first(waiting, [], Snapshot(cluster, table, index))  # type: ignore[arg-type]
    assert [(p.node_id, d.node_id) for p, d in pairs] == [("d0", "d0")]  # its own 40 tokens


def test_a_round_of_short_prompts_is_not_piled_onto_one_decode_node_past_the_budget():
    """Each prompt was judged alone on the node's last report: 12 waiting 300-token prompts
    of one placement round all went to one decode node (each under the 36 ms stall budget),
    which prefilled them in one step (~143 ms). Now the local prefills already placed there
    count: as many as the budget holds go local, the rest to the backed-up prefill pool."""
    from tests.unit.test_policies import Placed

    rule = LocalPrefill("adaptive", COST)
    placed = Placed(_cluster())  # 8 streams on d0: a 9 ms step, a budget of 4 steps
    p = COST.prefill_seconds(300)
    local = []
    for _ in range(12):
        decode = placed.nodes("decode")[0]  # from the table, as a round's snapshot derives it
        made = rule.decide(300, p, decode, placed.nodes("prefill"), queued_s=1.0)  # backed up
        if made.local:
            placed.in_prefill("d0", 300)  # accepted: in prefill on its decode node
            local.append(made)
    budget = 4 * local[0].step_s
    assert 1 < len(local) == int(budget // p) < 12
    assert all(m.queued_s + m.prefill_s <= m.threshold_s == budget for m in local)
    assert local[-1].queued_s == pytest.approx((len(local) - 1) * p)
