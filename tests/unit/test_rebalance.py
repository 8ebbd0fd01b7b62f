"""The decode pool's rebalancing rule (gateway/rebalance.py): when, what and how much."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from msgspec.structs import replace

from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.plan import views
from pdserve.gateway.rebalance import COOLDOWN, MOST, choose
from pdserve.gateway.table import RequestTable
from tests.conftest import gateway_request
from tests.unit.test_policies import cluster_with


def _running(table: RequestTable, node: str, rid: str, prompt: int, max_tokens: int) -> None:
    req = gateway_request(rid, prompt)
    req.params = replace(req.params, max_tokens=max_tokens)
    attempt = table.open(req, prompt)
    table.commit(attempt, "p0", node, -(-prompt // 16), 0.0)
    table.prefilled(attempt)
    table.delivered(attempt, 1.0)  # its KV arrived: it decodes there


def _reported(frees: dict[str, int], table: RequestTable) -> ClusterView:
    """Decode nodes whose reports show (hold) every sequence the table has on them."""
    cluster = cluster_with({}, frees)
    for node in cluster.nodes.values():
        node.held = frozenset(a.wire_id for a in table.headed_to(node.node_id))
    return cluster


def _setup(free0: int, free1: int, first_prompt: int = 32) -> tuple[list, RequestTable]:
    table = RequestTable()
    # growth left: 900, 100, 500, 700, 300, 800 tokens (prompts of 2 blocks, but the first)
    for i, growth in enumerate([900, 100, 500, 700, 300, 800]):
        _running(table, "d0", f"r{i}", first_prompt if i == 0 else 32, growth)
    return views(_reported({"d0": free0, "d1": free1}, table), table, "decode"), table


def test_a_full_node_moves_the_sequences_with_most_growth_left_to_the_empty_one():
    pool, table = _setup(free0=5, free1=95)  # 95 % and 5 % in use (100 blocks each)
    move = choose(pool, table, 0.9, {}, now=10.0)
    assert move is not None and (move.source, move.target) == ("d0", "d1")
    assert move.request_ids == ("r0.0", "r5.0", "r3.0", "r2.0")[:MOST]


def test_no_move_below_the_threshold_across_a_small_gap_or_within_the_cooldown():
    pool, table = _setup(free0=15, free1=95)  # 85 % in use: under 0.9
    assert choose(pool, table, 0.9, {}, 10.0) is None
    pool, table = _setup(free0=5, free1=20)  # 95 % against 80 %: too close to bother
    assert choose(pool, table, 0.9, {}, 10.0) is None
    pool, table = _setup(free0=5, free1=95)
    assert choose(pool, table, 0.9, {"d0": 10.0 - COOLDOWN / 2}, 10.0) is None
    assert choose(pool, table, 0.9, {"d0": 10.0 - COOLDOWN}, 10.0) is not None
    assert choose(pool, table, 0.0, {}, 10.0) is None  # off


def test_only_what_fits_on_the_target_and_never_a_sequence_already_moving():
    # the most growth is r0's, but its 60 blocks (960 tokens) do not fit in the 40 free
    pool, table = _setup(free0=0, free1=40, first_prompt=959)
    move = choose(pool, table, 0.9, {}, 10.0)
    assert move is not None and move.request_ids[0] == "r5.0" and "r0.0" not in move.request_ids
    pool, table = _setup(free0=0, free1=95)
    move = choose(pool, table, 0.9, {}, 10.0)
    assert move is not None and move.request_ids[0] == "r0.0"
    moving = table.get("r0.0")
    assert moving is not None
    table.migrate(moving, "d1", 3, 10.0)  # in flight: the old node holds it as "prefill"
    pool = views(_reported({"d0": 0, "d1": 95}, table), table, "decode")
    move = choose(pool, table, 0.9, {}, 11.0)
    assert move is not None and "r0.0" not in move.request_ids


def test_a_sequence_that_would_turn_the_gap_around_is_not_moved_to_bounce_back():
    """86 % against 10 %, most of it one 71-block sequence with growth left: moved, the
    target was 81 % full (past 0.8) and the source 15 %, and the next round (the target
    never a source before, so no cooldown) moved it back: its whole KV shipped each time."""
    table = RequestTable()
    _running(table, "d0", "big", 71 * 16 - 1, 2000)
    pool = views(_reported({"d0": 14, "d1": 90}, table), table, "decode")
    assert choose(pool, table, 0.8, {}, now=10.0) is None
    _running(table, "d0", "small", 20 * 16 - 1, 2000)  # one that halves the gap instead
    pool = views(_reported({"d0": 14, "d1": 90}, table), table, "decode")
    move = choose(pool, table, 0.8, {}, now=10.0)
    assert move is not None and move.request_ids == ("small.0",)


def test_a_move_that_turns_the_gap_but_leaves_the_target_below_the_threshold_is_made():
    # 92 % (one 60-block sequence) against 5 %: moved, 32 % and 65 %, the target under 0.9:
    # nothing would move it back, and kept, it fills d0 until a preemption recomputes it
    table = RequestTable()
    _running(table, "d0", "big", 60 * 16 - 1, 2000)
    pool = views(_reported({"d0": 8, "d1": 95}, table), table, "decode")
    move = choose(pool, table, 0.9, {}, now=10.0)
    assert move is not None and move.request_ids == ("big.0",)


def test_a_node_that_refused_kv_since_its_report_is_not_taken_for_the_fullest():
    # d0 is half full by its report, then refuses a KV (a timeout): it shows no free block
    # until its next report, and was taken for a full node whose sequences had to move
    _, table = _setup(free0=50, free1=90)
    cluster = _reported({"d0": 50, "d1": 90}, table)
    assert choose(views(cluster, table, "decode"), table, 0.6, {}, 10.0) is None
    cluster.nodes["d0"].refused_at = cluster.nodes["d0"].load_at
    assert choose(views(cluster, table, "decode"), table, 0.6, {}, 10.0) is None


def test_sequences_still_moving_off_the_source_count_as_gone():
    """A round's moves stay in the source's reports until each target acknowledges its KV
    (longer than the cooldown for large sequences): the next round took the source for as
    full as before and moved as much again, past halfway, and the round after moved back."""
    pool, table = _setup(free0=5, free1=95)
    move = choose(pool, table, 0.9, {}, now=10.0)
    assert move is not None and len(move.request_ids) == MOST  # 4 x 3 blocks
    for rid in move.request_ids:
        attempt = table.get(rid)
        assert attempt is not None
        table.migrate(attempt, "d1", 3, 10.0)  # on their way, 12 blocks: 95 % -> 83 %
    pool = views(_reported({"d0": 5, "d1": 95}, table), table, "decode")  # reports as before
    assert choose(pool, table, 0.9, {"d0": 10.0}, now=10.0 + 2 * COOLDOWN) is None


class _Link:
    gateway_id = "g"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    async def reply(self, identity: bytes, msg: object) -> None:
        self.sent.append((identity, msg))


def test_moved_sequences_go_to_the_target_the_rebalance_chose():
    """A 90 % full, B 78 % caching the sequences' 4-block system prompt, C empty. The round
    chose A -> C, but `Rebalance` names no target and each `Migrate` was placed by the
    policy, which prefers the node caching the prefix: all went to B (90 % full then), the
    next round moved them from B back to A, and C never got one."""
    from pdserve.common.config import GatewayConfig
    from pdserve.common.costmodel import CostModel
    from pdserve.common.wire.protocol import KvEvents, Migrate, Rebalance, Redirect
    from pdserve.gateway.metrics import GatewayMetrics
    from pdserve.gateway.node_messages import NodeMessages
    from pdserve.gateway.policies import make_policy
    from pdserve.gateway.pools import PoolCare
    from pdserve.gateway.prefix_index import PrefixIndex
    from pdserve.gateway.sizing import Sizing

    table, index = RequestTable(), PrefixIndex()
    system = tuple(i.to_bytes(16, "big") for i in range(4))
    for i in range(6):  # 70 tokens each (5 blocks), 30 more to come: 7 blocks in the end
        _running(table, "A", f"r{i}", 70, 30)
        attempt = table.get(f"r{i}.0")
        assert attempt is not None
        attempt.hashes = system
    cluster = _reported({"A": 10, "B": 22, "C": 100}, table)
    index.apply(KvEvents(node_id="B", seq=0, stored=list(system), snapshot=True))
    link, metrics = _Link(), GatewayMetrics(cluster, table, {})
    fake: Any = link  # replies only: no service or drop are needed
    placer: Any = SimpleNamespace(waiting={})  # its queue and the sizing: for the signal a
    sizing = Sizing(CostModel.named("h100-llama3.1-8b"))  # tick decides on a fresh view
    unused: Any = None
    pools = PoolCare(GatewayConfig(rebalance=0.75), cluster, table, placer, sizing, metrics, fake)
    policy = make_policy("on_demand")
    messages = NodeMessages(cluster, table, index, policy, unused, metrics, fake, unused, pools,
                            unused, "t")  # fmt: skip

    async def round_() -> list[str]:
        now = time.monotonic()
        for node in cluster.nodes.values():
            node.load_at = now  # their reports just read: pool care decides on a fresh view
        await pools.tick(now, 0.0)
        ((_, order),) = link.sent
        assert isinstance(order, Rebalance)
        link.sent.clear()
        for rid in order.request_ids:
            await messages._on_migrate(b"A", Migrate(request_id=rid, reason="rebalance"))
        return [m.decode.node_id if m.decode else "" for _, m in link.sent
                if isinstance(m, Redirect)]  # fmt: skip

    assert asyncio.run(round_()) == ["C"] * MOST


def test_a_planned_target_expired_or_full_leaves_the_choice_to_the_policy():
    from pdserve.gateway.plan import redirect
    from pdserve.gateway.policies import Need, make_policy
    from pdserve.gateway.rebalance import PLANNED_S, Move, Planned

    planned = Planned()
    planned.remember(Move("A", "C", ("r0.0", "r1.0")), now=10.0)
    assert planned.take("r0.0", 10.0 + PLANNED_S) is None  # its Migrate never came in time
    assert planned.take("r1.0", 11.0) == "C" and planned.take("r1.0", 11.0) is None
    policy, need = make_policy("on_demand"), Need(70, frozenset({"A"}))  # 5 blocks with its next
    for c_free, went in ((3, "B"), (50, "C")):
        cluster = cluster_with({}, {"B": 60, "C": c_free})
        target = redirect(policy, cluster, RequestTable(), need, None, "C")
        assert target is not None and target.node_id == went
