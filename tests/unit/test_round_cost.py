"""What a placement round and a registration cost: a round derives each node's view once
(gateway/plan.py Snapshot) and must see exactly what a fresh derivation sees; a node's
Register never hashes the vocabulary again (common/model/tokenizer.py)."""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.wire.protocol import KvEvents
from pdserve.gateway.plan import Snapshot, fetch_holders, plan, views
from pdserve.gateway.policies import Need, make_policy
from pdserve.gateway.prefix_index import PrefixIndex
from tests.unit.test_policies import Placed, cluster_with, make_info


def _cluster() -> tuple[Placed, PrefixIndex, list[Need]]:
    placed = Placed(cluster_with({"p0": (0, 0), "p1": (0, 0)}, {"d0": 400, "d1": 50}))
    placed.view.register(make_info("p2", data_address="tcp://p2:1"), b"p2", 0.0, "t")
    hashes = tuple(i.to_bytes(16, "big") for i in range(100))
    index = PrefixIndex()
    index.apply(KvEvents(node_id="p1", seq=0, stored=list(hashes[:60]), snapshot=True))
    index.apply(KvEvents(node_id="p2", seq=0, stored=list(hashes[:90]), snapshot=True))
    index.apply(KvEvents(node_id="d1", seq=0, stored=list(hashes[:10]), snapshot=True))
    placed.in_prefill("p1", 900, 300)
    placed.in_prefill("p0", 100, decode="d1")
    needs = [Need(1600, hashes=hashes), Need(800, hashes=hashes[:50]), Need(64), Need(3000)]
    return placed, index, needs


def test_a_round_sees_what_a_fresh_derivation_sees_for_every_request() -> None:
    placed, index, needs = _cluster()
    snap = Snapshot(placed.view, placed.table, index)
    for name in ("on_demand", "kv_aware", "round_robin", "jsq"):
        for need in needs:
            fresh = plan(make_policy(name), placed.view, placed.table, need, index)
            assert snap.plan(make_policy(name), need) == fresh, (name, need)  # views by value
            for role in ("prefill", "decode"):
                holders = fetch_holders(placed.view, index, need) if role == "prefill" else None
                derived = views(placed.view, placed.table, role, index, need, holders)
                assert snap.views(role, need, holders) == derived
    # a request without cached blocks shares the round's base views (nothing copied)
    assert snap.views("decode", Need(64))[0] is snap.base("decode")[0]


def test_a_round_sees_the_table_change_once_it_is_stale() -> None:
    placed, index, needs = _cluster()
    snap = Snapshot(placed.view, placed.table, index)
    before = {v.node_id: v.in_prefill for v in snap.base("prefill")}
    placed.in_prefill("p0", 700)  # an answer came while the round's offer was out
    assert {v.node_id: v.in_prefill for v in snap.base("prefill")} == before  # kept
    snap.stale()
    assert sorted({v.node_id: v.in_prefill for v in snap.base("prefill")}["p0"]) == [100, 700]
    assert snap.plan(make_policy("on_demand"), needs[0]) == plan(
        make_policy("on_demand"), placed.view, placed.table, needs[0], index
    )


def test_kv_aware_estimates_are_those_of_the_cost_model() -> None:
    placed, index, needs = _cluster()
    policy = make_policy("kv_aware", "h100-llama3.1-8b")
    fresh = make_policy("kv_aware", "h100-llama3.1-8b")
    nodes = views(placed.view, placed.table, "prefill", index, needs[0])
    for _ in range(2):  # the second pass answers from the memo
        for n in nodes:
            got = policy.estimate(n, 1600, n.cached_tokens)  # type: ignore[attr-defined]
            assert got == fresh.estimate(n, 1600, n.cached_tokens)  # type: ignore[attr-defined]
            q = sum(policy.cost.prefill_seconds(p) for p in n.in_prefill)
            assert got["queue_s"] == q


def test_the_vocabulary_is_hashed_once_per_process(tokenizer: Tokenizer) -> None:
    tok = replace(tokenizer)  # a fresh instance: nothing computed yet
    first = tok.fingerprint()

    def no_more(*_: object, **__: object) -> dict:
        raise AssertionError("the vocabulary was hashed again")

    backend = tok.backend
    tok.backend = type("NoVocab", (), {"get_vocab": no_more})()  # type: ignore[assignment]
    try:
        assert tok.fingerprint() == first  # every Register to every gateway: no new hash
    finally:
        tok.backend = backend
    assert replace(tokenizer).fingerprint() == first  # and it is the vocabulary's hash
