"""Decode placement weighs a node's room before its cached prefix, and on-demand's ties
rotate over the prefill nodes (gateway/policies/)."""

from __future__ import annotations

from pdserve.common.wire.protocol import KvEvents, Load
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.core import _count_answer
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.plan import views
from pdserve.gateway.policies import Need, make_policy
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.table import RequestTable
from tests.unit.test_policies import cluster_with, make_info

FITS = ("spread", "best_fit", "length_aware")


def _pick(fit: str, prompt: int, output: int) -> str:
    """A 96 % full (40 of 1,000 blocks free) caching a one-block system prompt; C empty."""
    cluster = ClusterView(2.0)
    for name, free in (("A", 40), ("C", 1000)):
        cluster.register(make_info(name, role="decode", num_blocks=1000), name.encode(), 0.0, "t")
        load = Load(running=0, waiting=0, blocks_free=free, blocks_cached=0,
                    blocks_in_use=1000 - free)  # fmt: skip
        cluster.heartbeat(name, name.encode(), load, 0.0)
    hashes = tuple(i.to_bytes(16, "big") for i in range(prompt // 16))
    index = PrefixIndex()
    index.apply(KvEvents(node_id="A", seq=0, stored=list(hashes[:1]), snapshot=True))
    need = Need(prompt, hashes=hashes, output_len=output)
    picked = make_policy("on_demand", decode_fit=fit).pick_decode(
        views(cluster, RequestTable(), "decode", index, need), need
    )
    assert picked is not None
    return picked.node_id


def test_a_cached_block_does_not_fill_a_node_without_room_for_the_final_kv():
    """516 prompt tokens + 2,000 to generate take 158 blocks; A has 40 (the prompt's 33
    fit). Every variant took A for its one cached block: preempted as it grew, recomputed,
    while C got nothing until the caching nodes were full."""
    assert [_pick(fit, 516, 2000) for fit in FITS] == ["C", "C", "C"]


def test_the_node_holding_the_conversation_is_still_first_when_it_has_room():
    # 516 + 100 tokens: 39 blocks, A's 40 hold them; its cached block saves a transfer
    assert [_pick(fit, 516, 100) for fit in FITS] == ["A", "A", "A"]


def test_on_demand_ties_go_to_the_node_that_accepted_longest_ago():
    """Ties went to the node with the fewest acceptances since it registered: a restarted
    node (0) won every tie until it caught up with the others' thousands."""
    cluster = cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 50})
    metrics = GatewayMetrics(cluster, RequestTable(), {})
    for _ in range(500):
        for name in ("p0", "p1"):
            _count_answer(metrics, cluster, cluster.nodes[name], True)
    cluster.register(make_info("p2"), b"p2", 0.0, "t")  # new, or restarted under its id
    policy, firsts = make_policy("on_demand"), []
    for _ in range(6):  # a trickle: each request finds every node idle again
        first = policy.prefill_order(views(cluster, RequestTable(), "prefill"), Need(10))[0]
        _count_answer(metrics, cluster, first.node, True)
        firsts.append(first.node_id)
    assert firsts == ["p2", "p0", "p1", "p2", "p0", "p1"]
