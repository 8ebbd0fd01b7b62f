"""Pure policies of the serving path: the cluster view, the placement
policies over views derived from the request table, and the policy registry."""

from __future__ import annotations

import msgspec
import pytest
from msgspec.structs import replace

from pdserve.common.wire.protocol import Load, NodeInfo
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.plan import plan, views
from pdserve.gateway.policies import REGISTRY, Need, NodeView, Policy, make_policy, names, register
from pdserve.gateway.policies.kv_aware import SLACK
from pdserve.gateway.policies.on_demand import OnDemand
from pdserve.gateway.table import RequestTable
from tests.conftest import gateway_request


def make_info(node_id: str, role: str = "prefill", **kw) -> NodeInfo:
    base = dict(
        node_id=node_id,
        role=role,
        data_address="",
        host_id="h",
        model_id="m",
        dtype="float32",
        tokenizer_fingerprint="t",
        kv_layout="k",
        block_size=16,
        num_blocks=100,
        max_batch=4,
        max_batch_tokens=1000,
        max_model_len=8192,
    )
    base.update(kw)
    return NodeInfo(**base)


def test_cluster_refuses_mismatches_and_duplicates():
    view = ClusterView(heartbeat_timeout=2.0)
    assert view.register(make_info("p0"), b"p0/1", 0.0, "t") is None
    assert "dtype" in view.register(make_info("p1", dtype="bfloat16"), b"p1/1", 0.0, "t")
    assert "kv_layout" in view.register(make_info("p1", kv_layout="z"), b"p1/1", 0.0, "t")
    assert "tokenizes differently" in view.register(make_info("p1"), b"p1/1", 0.0, "other")
    assert "already registered" in view.register(make_info("p0", host_id="x"), b"p0/2", 0.0, "t")
    assert view.register(make_info("p0"), b"p0/1", 0.5, "t") is None  # same node, again
    assert view.health() is not None and "decode" in view.health()
    assert view.register(make_info("d0", role="decode"), b"d0/1", 0.0, "t") is None
    assert view.health() is None


def test_silent_nodes_expire_and_heartbeats_need_the_same_socket():
    view = ClusterView(heartbeat_timeout=2.0)
    view.register(make_info("p0"), b"p0/1", 0.0, "t")
    load = Load(running=1, waiting=0, blocks_free=10, blocks_cached=0, blocks_in_use=5)
    assert view.heartbeat("p0", b"p0/1", load, 1.5)
    assert not view.heartbeat("p0", b"impostor", load, 1.6)
    assert view.expired(3.0) == [] and view.expired(3.6) == ["p0"]


class Placed:
    """A cluster view and a request table, with requests placed by hand."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.table = RequestTable()
        self.count = 0

    def in_prefill(self, node: str, *prompt_lens: int, decode: str = "d0") -> None:
        for n in prompt_lens:
            self.count += 1
            req = gateway_request(f"r{self.count}", n)
            attempt = self.table.open(req, n)
            self.table.commit(attempt, node, decode, -(-n // 16), now=1.0)

    def nodes(self, role: str) -> list[NodeView]:
        return views(self.view, self.table, role)


def test_on_demand_orders_by_prefill_work_in_hand_and_picks_roomiest_decode():
    placed = Placed(
        cluster_with(
            {"p0": (0, 0), "p1": (0, 0), "p2": (0, 0), "p3": (0, 0)},
            {"d0": 10, "d1": 40, "d2": 1},
        )
    )
    placed.in_prefill("p0", 10, 10)
    placed.in_prefill("p2", 10)
    placed.in_prefill("p3", 6000, decode="dx")  # one request, the most work: a new one waits most
    policy = make_policy("on_demand")
    assert isinstance(policy, OnDemand) and not policy.queueing
    order = policy.prefill_order(placed.nodes("prefill"), Need(10))
    assert [n.node_id for n in order] == ["p1", "p2", "p0", "p3"]
    decode = placed.nodes("decode")
    assert policy.pick_decode(decode, Need(100)).node_id == "d1"
    assert policy.pick_decode(decode, Need(100, frozenset({"d1"}))).node_id == "d0"
    assert policy.pick_decode(decode, Need(1000)) is None
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_policy("magic")
    assert msgspec.structs.replace(make_info("x"), dtype="f").dtype == "f"


def test_free_blocks_count_what_was_promised_until_a_report_shows_it_reserved():
    placed = Placed(cluster_with({"p0": (0, 0)}, {"d0": 40}))
    placed.in_prefill("p0", 160, decode="d0")  # 10 blocks, promised after the report at 0.0
    assert placed.nodes("decode")[0].free_blocks == 30
    # a newer report, sent before the KV's header came (the prefill node had not scheduled
    # the prompt yet): the node has not reserved them. They stopped counting here, and a
    # second request took the same room: refused at its header, its prefill spent for naught
    load = placed.view.nodes["d0"].load
    placed.view.heartbeat("d0", b"d0", load, 2.0)
    assert placed.nodes("decode")[0].free_blocks == 30
    reserved = msgspec.structs.replace(load, blocks_free=30, blocks_in_use=10, held=("r1.0",))
    placed.view.heartbeat("d0", b"d0", reserved, 3.0)
    assert placed.nodes("decode")[0].free_blocks == 30  # it shows them itself now


def test_a_refusal_is_newer_than_the_report_it_contradicts():
    placed = Placed(cluster_with({"p0": (0, 0)}, {"d0": 40}))
    placed.view.nodes["d0"].refused_at = 1.0  # refused KV after its report at 0.0
    assert placed.nodes("decode")[0].free_blocks == 0
    placed.view.heartbeat("d0", b"d0", placed.view.nodes["d0"].load, 2.0)
    assert placed.nodes("decode")[0].free_blocks == 40


def cluster_with(
    prefill_loads: dict[str, tuple[int, int]],
    decode_free: dict[str, int],
    in_use: dict[str, int] | None = None,
) -> ClusterView:
    view = ClusterView(2.0)
    for name, (waiting, running) in prefill_loads.items():
        view.register(make_info(name), name.encode(), 0.0, "t")
        view.heartbeat(
            name,
            name.encode(),
            Load(
                running=running, waiting=waiting, blocks_free=100, blocks_cached=0, blocks_in_use=0
            ),
            0.0,
        )
    for name, free in decode_free.items():
        view.register(make_info(name, role="decode"), name.encode(), 0.0, "t")
        used = (in_use or {}).get(name, 0)
        view.heartbeat(
            name,
            name.encode(),
            Load(running=0, waiting=0, blocks_free=free, blocks_cached=0, blocks_in_use=used),
            0.0,
        )
    return view


def test_round_robin_takes_turns_on_both_pools():
    placed = Placed(cluster_with({"p0": (0, 0), "p1": (5, 0), "p2": (0, 0)}, {"d0": 50, "d1": 50}))
    policy = make_policy("round_robin")
    assert policy.queueing
    firsts = [policy.prefill_order(placed.nodes("prefill"), Need(10))[0].node_id for _ in range(4)]
    assert firsts == ["p0", "p1", "p2", "p0"]  # load is ignored, by design
    decodes = [policy.pick_decode(placed.nodes("decode"), Need(10)).node_id for _ in range(3)]
    assert decodes == ["d0", "d1", "d0"]


def test_jsq_joins_the_shortest_prefill_queue_and_least_used_decode():
    placed = Placed(
        cluster_with(
            {"p0": (3, 1), "p1": (0, 1), "p2": (1, 1)}, {"d0": 50, "d1": 50}, {"d0": 30, "d1": 10}
        )
    )
    policy = make_policy("jsq")
    order = policy.prefill_order(placed.nodes("prefill"), Need(10))
    assert [n.node_id for n in order] == ["p1", "p2", "p0"]
    placed.in_prefill("p1", 1, 1, 1, 1, 1, decode="d1")  # sent since its report
    assert policy.prefill_order(placed.nodes("prefill"), Need(10))[0].node_id == "p2"
    assert policy.pick_decode(placed.nodes("decode"), Need(10)).node_id == "d1"  # 10 + 5 < 30


def test_jsq_counts_a_warm_cache_as_free_not_as_negative_use():
    """A's 100 blocks in use and 100 cached scored 0 (cached blocks were subtracted from its
    use): JSQ picked the fuller node over B, 40 in use, nothing cached."""
    view = cluster_with({}, {"A": 100, "B": 160}, {"A": 100, "B": 40})
    load = view.nodes["A"].load
    view.heartbeat("A", b"A", msgspec.structs.replace(load, blocks_free=0, blocks_cached=100), 0.0)
    decode = views(view, RequestTable(), "decode")
    assert {n.node_id: n.blocks_in_use for n in decode} == {"A": 100, "B": 40}
    assert make_policy("jsq").pick_decode(decode, Need(10)).node_id == "B"
    view.nodes["B"].refused_at = 1.0  # refused since its report: every block counts
    assert {n.node_id: n.blocks_in_use for n in views(view, RequestTable(), "decode")}["B"] == 200


def test_kv_aware_minimises_estimated_ttft_with_the_cost_formula(caplog):
    from pdserve.common.costmodel import CostModel

    placed = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 50}))
    placed.in_prefill("p0", 4000)  # one long prompt queued there
    placed.in_prefill("p1", 100, 100, 100)  # three short ones
    policy = make_policy("kv_aware", "h100-llama3.1-8b")
    cost = CostModel.named("h100-llama3.1-8b")
    p1 = next(n for n in placed.nodes("prefill") if n.node_id == "p1")
    est = policy.estimate(p1, 1000)  # type: ignore[attr-defined]
    assert est["queue_s"] == pytest.approx(3 * cost.prefill_seconds(100))
    assert est["ttft_s"] == pytest.approx(
        3 * cost.prefill_seconds(100) + cost.prefill_seconds(1000) + cost.transfer_seconds(1000)
    )
    with caplog.at_level("DEBUG", logger="pdserve.gateway.policies.kv_aware"):
        order = policy.prefill_order(placed.nodes("prefill"), Need(1000))
    # 3 x 100 queued beats 1 x 4000, by far more than SLACK: p0 is not offered at all
    assert [n.node_id for n in order] == ["p1"]
    assert "ttft_s" in caplog.text and "queue_s" in caplog.text
    assert not policy.queueing  # nodes answer by batch room; the wait is at the gateway


def test_kv_aware_offers_every_node_near_the_best_and_waits_for_the_holder():
    from pdserve.common.wire.protocol import KvEvents
    from pdserve.gateway.prefix_index import PrefixIndex

    policy = make_policy("kv_aware", "h100-llama3.1-8b")
    idle = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0), "p2": (0, 0)}, {"d0": 50}))
    order = policy.prefill_order(idle.nodes("prefill"), Need(1000))
    assert sorted(n.node_id for n in order) == ["p0", "p1", "p2"]  # equal: all offered
    # p1 holds 1,920 of a 2,000-token prompt and is busy with a short batch: the request
    # goes to p1 only (its batch full, it waits at the gateway), not cold to p0 or p2
    hashes = tuple(i.to_bytes(16, "big") for i in range(125))
    index = PrefixIndex()
    index.apply(KvEvents(node_id="p1", seq=0, stored=list(hashes[:120]), snapshot=True))
    idle.in_prefill("p1", 100, 100)
    need = Need(2000, hashes=hashes)
    order = policy.prefill_order(views(idle.view, idle.table, "prefill", index, need), need)
    assert [n.node_id for n in order] == ["p1"]
    # once its queued work costs more than computing the prompt cold, the others get it
    idle.in_prefill("p1", *[4000] * 8)
    order = policy.prefill_order(views(idle.view, idle.table, "prefill", index, need), need)
    assert order[0].node_id in {"p0", "p2"} and "p1" not in [n.node_id for n in order]


def test_plan_pairs_every_prefill_candidate_with_one_decode_node():
    placed = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 10, "d1": 40}))
    pairs = plan(make_policy("on_demand"), placed.view, placed.table, Need(100))
    assert [(p.node_id, d.node_id) for p, d in pairs] == [("p0", "d1"), ("p1", "d1")]
    assert plan(make_policy("on_demand"), placed.view, placed.table, Need(10_000)) == []


def test_a_policy_is_one_module_registered_by_name():
    @register
    class Fewest(Policy):
        name = "test_fewest_id"

        def prefill_order(self, nodes, need):
            return sorted(nodes, key=lambda n: n.node_id, reverse=True)

    try:
        assert "test_fewest_id" in names() and {"on_demand", "jsq"} <= set(names())
        policy = make_policy("test_fewest_id")
        placed = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 10}))
        assert plan(policy, placed.view, placed.table, Need(10))[0][0].node_id == "p1"
        assert policy.pick_decode(placed.nodes("decode"), Need(10)).node_id == "d0"  # default
        with pytest.raises(ValueError, match="two placement policies"):
            register(type("Other", (Policy,), {"name": "test_fewest_id"}))
    finally:
        REGISTRY.pop("test_fewest_id", None)


def test_cache_aware_order_sends_a_request_where_its_prefix_is():
    from pdserve.common.wire.protocol import KvEvents
    from pdserve.gateway.prefix_index import PrefixIndex

    placed = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 40, "d1": 50}))
    hashes = tuple(i.to_bytes(16, "big") for i in range(200))  # a 3,200-token prompt
    index = PrefixIndex()
    index.apply(KvEvents(node_id="p1", seq=0, stored=list(hashes[:180]), snapshot=True))
    index.apply(KvEvents(node_id="d0", seq=0, stored=list(hashes[:3]), snapshot=True))
    placed.in_prefill("p1", 10)  # busier, but it holds the prefix
    need = Need(3200, hashes=hashes)
    for node in ("d0", "d1"):  # room for it on both decode nodes
        load = placed.view.nodes[node].load
        placed.view.heartbeat(node, node.encode(), replace(load, blocks_free=400), 0.0)
    pairs = plan(make_policy("on_demand"), placed.view, placed.table, need, index)
    assert [(p.node_id, p.cached, d.node_id, d.cached) for p, d in pairs] == [
        ("p1", 180, "d0", 3),  # d0 holds the conversation although d1 has as much room
        ("p0", 0, "d0", 3),
    ]
    kv = make_policy("kv_aware")
    assert (
        kv.prefill_order(views(placed.view, placed.table, "prefill", index, need), need)[0].node_id
        == "p1"
    )
    plain = plan(make_policy("on_demand"), placed.view, placed.table, Need(3200))
    assert [(p.node_id, d.node_id) for p, d in plain] == [("p0", "d1"), ("p1", "d1")]


def test_a_node_missing_the_prefix_is_told_who_holds_it_and_kv_aware_counts_the_fetch():
    from pdserve.common.costmodel import CostModel
    from pdserve.common.wire.protocol import KvEvents
    from pdserve.gateway.plan import fetch_holders
    from pdserve.gateway.prefix_index import PrefixIndex

    placed = Placed(cluster_with({"p0": (0, 0)}, {"d0": 4000}))
    placed.view.register(make_info("p1", data_address="tcp://p1:1"), b"p1", 0.0, "t")
    placed.view.register(make_info("p2"), b"p2", 0.0, "t")  # no data socket: cannot send KV
    hashes = tuple(i.to_bytes(16, "big") for i in range(200))  # a 3,200-token prompt
    index = PrefixIndex()
    index.apply(KvEvents(node_id="p1", seq=0, stored=list(hashes[:180]), snapshot=True))
    index.apply(KvEvents(node_id="p2", seq=0, stored=list(hashes), snapshot=True))
    index.apply(KvEvents(node_id="p0", seq=0, stored=list(hashes[:20]), snapshot=True))
    need = Need(3200, hashes=hashes)
    assert [(b, n.node_id) for b, n in fetch_holders(placed.view, index, need)] == [(180, "p1")]
    placed.in_prefill("p1", 3000, 3000, 3000, 3000)  # the holder is busy
    nodes = {
        n.node_id: n
        for n in views(
            placed.view,
            placed.table,
            "prefill",
            index,
            need,
            fetch_holders(placed.view, index, need),
        )
    }
    p0, p1 = nodes["p0"], nodes["p1"]
    assert (p0.holder.node_id, p0.holder_blocks, p0.fetchable_tokens) == ("p1", 180, 160 * 16)
    assert p1.holder is None and p1.cached == 180  # nobody holds more than it does
    policy = make_policy("kv_aware", "h100-llama3.1-8b")
    cost = CostModel.named("h100-llama3.1-8b")
    est = policy.estimate(p0, 3200, p0.cached_tokens, p0.fetchable_tokens)  # type: ignore[attr-defined]
    assert est["fetched_tokens"] == 2560 and est["fetch_s"] == cost.transfer_seconds(2560)
    assert est["ttft_s"] == pytest.approx(
        cost.transfer_seconds(2560)
        + cost.prefill_seconds(3200 - 320 - 2560, 320 + 2560)
        + cost.transfer_seconds(3200)
    )
    blind = policy.estimate(p0, 3200, p0.cached_tokens)  # type: ignore[attr-defined]
    assert blind["fetched_tokens"] == 0 and blind["ttft_s"] > est["ttft_s"]
    estimates = {
        n.node_id: policy.estimate(n, 3200, n.cached_tokens, n.fetchable_tokens)["ttft_s"]  # type: ignore[attr-defined]
        for n in nodes.values()
    }
    # p2 holds it all itself; fetching at p0 beats waiting behind 12,000 queued tokens at p1
    assert estimates["p2"] < estimates["p0"] < estimates["p1"]
    order = policy.prefill_order(list(nodes.values()), need)
    # offered only to the nodes within SLACK of the best estimate, best first
    assert [n.node_id for n in order] == [
        k for k in ("p2", "p0", "p1") if estimates[k] <= estimates["p2"] * SLACK
    ]
    assert order[0].node_id == "p2"
    offer_pairs = plan(policy, placed.view, placed.table, need, index)
    assert [p.node_id for p, _ in offer_pairs] == [n.node_id for n in order]
    # the holder busy, nobody holding the prefix whole: fetching at p0 is the only offer
    del nodes["p2"]
    assert [n.node_id for n in policy.prefill_order(list(nodes.values()), need)] == ["p0"]
    assert policy.prefill_order(list(nodes.values()), need)[0].holder.node_id == "p1"


def test_decode_placement_variants_spread_best_fit_and_length_aware():
    # decode nodes of 100 blocks x 16 tokens: a request is long there from 200 final tokens
    placed = Placed(cluster_with({"p0": (0, 0)}, {"d0": 60, "d1": 20, "d2": 35}))

    def pick(fit: str, prompt: int, output: int) -> str:
        policy = make_policy("on_demand", decode_fit=fit)
        return policy.pick_decode(placed.nodes("decode"), Need(prompt, output_len=output)).node_id

    assert pick("spread", 100, 300) == "d0"  # the most free blocks
    assert pick("best_fit", 100, 300) == "d2"  # 25 blocks: the tightest node that holds it all
    assert pick("best_fit", 100, 500) == "d0"  # 38 blocks: only d0 holds it all
    assert pick("best_fit", 100, 3000) == "d0"  # nobody holds it all: spread
    assert pick("best_fit", 10, 10) == "d1"
    placed.in_prefill("p0", 300, decode="d0")  # a long request (316 final tokens) on d0
    assert placed.nodes("decode")[0].long_decoding == 1
    assert pick("length_aware", 100, 300) == "d0"  # long: with the other long one
    assert pick("best_fit", 100, 300) == "d2"
    assert pick("length_aware", 10, 10) == "d1"  # short: away from it, then the tightest fit
    with pytest.raises(ValueError, match="unknown decode placement"):
        make_policy("on_demand", decode_fit="random")
