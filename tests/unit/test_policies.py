"""Pure policies of the serving path: the prefill batcher, the cluster view, on-demand order."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.common.protocol import DecodeTarget, Load, NodeInfo
from pdserve.common.sampling import SamplingParams
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.schedulers import OnDemand, make_policy
from pdserve.prefill_node.batcher import PrefillBatcher, PrefillJob

TARGET = DecodeTarget(node_id="d", data_address="tcp://x:1", host_id="h")


def make_job(rid: str, n: int) -> PrefillJob:
    return PrefillJob(rid, list(range(n)), SamplingParams(), TARGET, n, 0.0)


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


def test_on_demand_batcher_rejects_when_batch_or_budget_is_full():
    b = PrefillBatcher(
        max_batch=2, max_batch_tokens=100, block_size=16, num_blocks=50, queueing=False
    )
    assert b.offer(make_job("a", 60), free_blocks=50) is None
    assert "token budget" in b.offer(make_job("b", 50), free_blocks=50)
    assert b.offer(make_job("c", 30), free_blocks=50) is None
    assert "batch full" in b.offer(make_job("d", 1), free_blocks=50)
    assert [j.request_id for j in b.next_batch(free_blocks=50)] == ["a", "c"]
    assert "batch full" in b.offer(make_job("e", 1), free_blocks=50)  # running counts too
    b.batch_done()
    assert b.offer(make_job("e", 1), free_blocks=50) is None


def test_long_prompt_alone_and_kv_room():
    b = PrefillBatcher(
        max_batch=4, max_batch_tokens=100, block_size=16, num_blocks=50, queueing=False
    )
    assert b.offer(make_job("long", 300), free_blocks=50) is None  # alone: accepted
    assert "exceeds" in b.offer(make_job("huge", 16 * 51), free_blocks=50)
    b2 = PrefillBatcher(4, 1000, 16, 50, queueing=False)
    assert "KV cache full" in b2.offer(make_job("x", 64), free_blocks=3)


def test_queueing_mode_accepts_and_batches_fifo():
    b = PrefillBatcher(
        max_batch=2, max_batch_tokens=100, block_size=16, num_blocks=50, queueing=True
    )
    for i in range(5):
        assert b.offer(make_job(str(i), 40), free_blocks=50) is None
    assert [j.request_id for j in b.next_batch(50)] == ["0", "1"]
    b.batch_done()
    assert [j.request_id for j in b.next_batch(50)] == ["2", "3"]
    assert b.remove("4") is not None and not b.pending


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


def test_on_demand_orders_by_requests_in_prefill_and_picks_roomiest_decode():
    view = ClusterView(2.0)
    for name in ("p0", "p1", "p2"):
        view.register(make_info(name), name.encode(), 0.0, "t")
    for name, free in (("d0", 10), ("d1", 40), ("d2", 1)):
        view.register(make_info(name, role="decode"), name.encode(), 0.0, "t")
        view.heartbeat(
            name,
            name.encode(),
            Load(running=0, waiting=0, blocks_free=free, blocks_cached=0, blocks_in_use=0),
            0.0,
        )
    view.nodes["p0"].in_prefill.update(a=10, b=10)
    view.nodes["p2"].in_prefill.update(c=10)
    policy = make_policy("on_demand")
    assert isinstance(policy, OnDemand)
    assert [n.node_id for n in policy.prefill_order(view.alive("prefill"), 10)] == [
        "p1",
        "p2",
        "p0",
    ]
    assert policy.pick_decode(view.alive("decode"), 100, set()).node_id == "d1"
    assert policy.pick_decode(view.alive("decode"), 100, {"d1"}).node_id == "d0"
    assert policy.pick_decode(view.alive("decode"), 1000, set()) is None
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_policy("magic")
    assert msgspec.structs.replace(make_info("x"), dtype="f").dtype == "f"


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
    view = cluster_with({"p0": (0, 0), "p1": (5, 0), "p2": (0, 0)}, {"d0": 50, "d1": 50})
    policy = make_policy("round_robin")
    assert policy.queueing
    firsts = [policy.prefill_order(view.alive("prefill"), 10)[0].node_id for _ in range(4)]
    assert firsts == ["p0", "p1", "p2", "p0"]  # load is ignored, by design
    decodes = [policy.pick_decode(view.alive("decode"), 10, set()).node_id for _ in range(3)]
    assert decodes == ["d0", "d1", "d0"]


def test_jsq_joins_the_shortest_prefill_queue_and_least_used_decode():
    view = cluster_with(
        {"p0": (3, 1), "p1": (0, 1), "p2": (1, 1)},
        {"d0": 50, "d1": 50},
        in_use={"d0": 30, "d1": 10},
    )
    policy = make_policy("jsq")
    assert [n.node_id for n in policy.prefill_order(view.alive("prefill"), 10)] == [
        "p1",
        "p2",
        "p0",
    ]
    view.nodes["p1"].in_prefill.update(a=1, b=1, c=1, d=1, e=1)  # sent since its report
    assert policy.prefill_order(view.alive("prefill"), 10)[0].node_id == "p2"
    assert policy.pick_decode(view.alive("decode"), 10, set()).node_id == "d1"


def test_kv_aware_minimises_estimated_ttft_with_the_cost_formula(caplog):
    from pdserve.common.costmodel import CostModel

    view = cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 50})
    view.nodes["p0"].in_prefill.update(a=4000)  # one long prompt queued there
    view.nodes["p1"].in_prefill.update(b=100, c=100, d=100)  # three short ones
    policy = make_policy("kv_aware", "h100-llama3.1-8b")
    cost = CostModel.named("h100-llama3.1-8b")
    est = policy.estimate(view.nodes["p1"], 1000)
    assert est["queue_s"] == pytest.approx(3 * cost.prefill_seconds(100))
    assert est["ttft_s"] == pytest.approx(
        3 * cost.prefill_seconds(100) + cost.prefill_seconds(1000) + cost.transfer_seconds(1000)
    )
    with caplog.at_level("DEBUG", logger="pdserve.gateway.schedulers"):
        order = policy.prefill_order(view.alive("prefill"), 1000)
    assert [n.node_id for n in order] == ["p1", "p0"]  # 3 x 100 queued beats 1 x 4000
    assert "ttft_s" in caplog.text and "queue_s" in caplog.text
