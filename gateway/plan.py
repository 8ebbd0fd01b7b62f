"""Placement decisions as one pure function: `plan(policy, cluster, table, need)` lists the
(prefill node, decode node) pairs to offer a request to, in order. First placements,
re-placements and redirects all go through it; the placer only runs the offer protocol over
the plan (gateway/placement.py).

The nodes a policy sees are `NodeView`s derived here from each node's last load report and
the request table: requests in prefill on it, KV headed to it, and free blocks less what was
promised since its report. A colocated node is its own decode node.
"""

from __future__ import annotations

from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.policies import Need, NodeView, Policy
from pdserve.gateway.table import RequestTable

Pair = tuple[NodeView, NodeView]


def view(node: NodeState, table: RequestTable) -> NodeView:
    node_id = node.node_id
    load = node.load
    promised = table.promised_since(node_id, node.load_at)
    free = load.blocks_free + load.blocks_cached - promised
    if node.refused_at >= node.load_at:
        free = 0  # it refused KV since its report: that report overstates its room
    return NodeView(
        node=node,
        in_prefill=tuple(a.prompt_len for a in table.in_prefill(node_id)),
        decoding=len(table.headed_to(node_id)),
        free_blocks=free,
    )


def views(cluster: ClusterView, table: RequestTable, role: str) -> list[NodeView]:
    return [view(n, table) for n in cluster.alive(role)]


def plan(policy: Policy, cluster: ClusterView, table: RequestTable, need: Need) -> list[Pair]:
    colocated = views(cluster, table, "colocated")
    if colocated:  # the colocated baseline: one engine runs both phases of a request
        return [(n, n) for n in policy.prefill_order(colocated, need)]
    decode = policy.pick_decode(views(cluster, table, "decode"), need)
    if decode is None:
        return []
    return [(n, decode) for n in policy.prefill_order(views(cluster, table, "prefill"), need)]


def redirect(
    policy: Policy, cluster: ClusterView, table: RequestTable, need: Need
) -> NodeView | None:
    """Another decode node for KV its decode node refused (the prefill node stays)."""
    return policy.pick_decode(views(cluster, table, "decode"), need)
