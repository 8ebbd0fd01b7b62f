"""Placement decisions as one pure function: `plan(policy, cluster, table, need)` lists the
(prefill node, decode node) pairs to offer a request to, in order. First placements,
re-placements and redirects all go through it; the placer only runs the offer protocol over
the plan (gateway/placement.py).

The nodes a policy sees are `NodeView`s derived here from each node's last load report and
the request table: requests in prefill on it, KV headed to it, and free blocks less what was
promised that its report does not show; with several gateways, plus what the node says it
holds for the others (`Load.foreign`, `Accept.foreign`). A colocated node is its own decode node.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.prefix import hash_salt, prefix_hashes
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.policies import Need, NodeView, Policy
from pdserve.gateway.policies.base import LONG_SHARE, fits
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.table import RequestTable

Pair = tuple[NodeView, NodeView]


def view(
    node: NodeState,
    table: RequestTable,
    index: PrefixIndex | None = None,
    need: Need | None = None,
    holders: list[tuple[int, NodeState]] | None = None,
) -> NodeView:
    return for_need(base_view(node, table), index, need, holders)


def base_view(node: NodeState, table: RequestTable) -> NodeView:
    """What a node weighs for any request: its report, and the table since it."""
    node_id = node.node_id
    load = node.load
    promised = table.promised(node_id, node.load_at, node.held)
    free = load.blocks_free + load.blocks_cached - promised
    if node.refused_at >= node.load_at:
        free = 0  # it refused KV since its report: that report overstates its room
    headed = table.headed_to(node_id)
    capacity = node.info.num_blocks * node.info.block_size
    other = node.foreign  # what other gateways' requests weigh on it (several gateways)
    return NodeView(
        node=node,
        in_prefill=(*(a.prompt_len for a in table.in_prefill(node_id)), *other.prefill),
        decoding=len(headed) + other.decoding,
        long_decoding=sum(1 for a in headed if a.final_len * LONG_SHARE >= capacity),
        free_blocks=free,
    )


def for_need(
    base: NodeView,
    index: PrefixIndex | None,
    need: Need | None,
    holders: list[tuple[int, NodeState]] | None = None,
) -> NodeView:
    """`base` for one request: how much of its prefix the node's cache holds, and the node
    holding most of it other than this one (a fetch hint if more)."""
    node_id = base.node_id
    cached = index.cached_blocks(node_id, need.hashes) if index and need else 0
    best = next(((b, h) for b, h in holders or () if h.node_id != node_id), (0, None))
    if not cached and best[0] <= 0:
        return base
    holder = best[0] > cached
    return replace(
        base,
        cached=cached,
        holder=best[1] if holder else None,
        holder_blocks=best[0] if holder else 0,
    )


def views(
    cluster: ClusterView,
    table: RequestTable,
    role: str,
    index: PrefixIndex | None = None,
    need: Need | None = None,
    holders: list[tuple[int, NodeState]] | None = None,
) -> list[NodeView]:
    return [view(n, table, index, need, holders) for n in cluster.alive(role)]


class Snapshot:
    """The nodes as one placement round sees them: each node's base view derived once, each
    waiting request adding only its own prefix hits. Derived per request, a round cost
    waiting x nodes x table: with hundreds of requests waiting and a round at every node
    report, rounds took most of a gateway's CPU (a profiled 8-gateway backlog: 35 of 42 s).
    `stale()` after anything was sent: answers and reports may arrive meanwhile."""

    def __init__(self, cluster: ClusterView, table: RequestTable, index: PrefixIndex | None):
        self.cluster, self.table, self.index = cluster, table, index
        self._base: dict[str, list[NodeView]] = {}

    def stale(self) -> None:
        self._base.clear()

    def base(self, role: str) -> list[NodeView]:
        got = self._base.get(role)
        if got is None:
            got = self._base[role] = [base_view(n, self.table) for n in self.cluster.alive(role)]
        return got

    def views(
        self, role: str, need: Need, holders: list[tuple[int, NodeState]] | None = None
    ) -> list[NodeView]:
        return [for_need(b, self.index, need, holders) for b in self.base(role)]

    def plan(self, policy: Policy, need: Need) -> list[Pair]:
        colocated = self.views("colocated", need)
        if colocated:
            return choose(policy, colocated, [], [], need)
        decode = self.views("decode", need)
        if not decode:
            return []
        holders = fetch_holders(self.cluster, self.index, need)
        return choose(policy, [], decode, self.views("prefill", need, holders), need)


def fetch_holders(
    cluster: ClusterView, index: PrefixIndex | None, need: Need
) -> list[tuple[int, NodeState]]:
    """Nodes whose caches hold a leading part of the request and can send it (a data
    socket), most blocks first."""
    if index is None or not need.hashes:
        return []
    found = [
        (blocks, node)
        for node_id, blocks in index.holders(need.hashes).items()
        if (node := cluster.nodes.get(node_id)) is not None and node.info.data_address
    ]
    return sorted(found, key=lambda pair: (-pair[0], pair[1].node_id))


def plan(
    policy: Policy,
    cluster: ClusterView,
    table: RequestTable,
    need: Need,
    index: PrefixIndex | None = None,
) -> list[Pair]:
    return Snapshot(cluster, table, index).plan(policy, need)


def choose(
    policy: Policy,
    colocated: list[NodeView],
    decode: list[NodeView],
    prefill: list[NodeView],
    need: Need,
) -> list[Pair]:
    """The pairs to offer, from the nodes' views (`plan` derives them; the planner's
    simulation keeps them between decisions while no node changed)."""
    if colocated:  # the colocated baseline: one engine runs both phases of a request
        return [(n, n) for n in policy.prefill_order(colocated, need)]
    picked = policy.pick_decode(decode, need)
    if picked is None:
        return []
    return [(n, picked) for n in policy.prefill_order(prefill, need)]


def redirect(
    policy: Policy,
    cluster: ClusterView,
    table: RequestTable,
    need: Need,
    index: PrefixIndex | None = None,
    planned: str | None = None,
) -> NodeView | None:
    """Another decode node for KV its decode node refused (the prefill node stays), or for a
    sequence leaving its decode node: `planned`, the target a rebalance chose for it, while
    it still fits there, else the policy's choice."""
    nodes = views(cluster, table, "decode", index, need)
    there = next((n for n in fits(nodes, need) if n.node_id == planned), None)
    return there or policy.pick_decode(nodes, need)


def request_hashes(cluster: ClusterView, prompt_ids: list[int]) -> tuple[bytes, ...]:
    """The chained hashes of a prompt's full blocks, as the nodes' caches key them (the
    cluster's model, dtype and block size salt them)."""
    ref = cluster.reference
    if ref is None:
        return ()
    salt = hash_salt(ref.model_id, ref.dtype, ref.block_size)
    return tuple(prefix_hashes(prompt_ids, ref.block_size, salt))
