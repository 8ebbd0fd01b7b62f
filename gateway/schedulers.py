"""Placement policies: which prefill nodes to offer a request to, in what order, and which
decode node receives its KV. Pure: they read the cluster view and return decisions.

`on_demand` (P/D-Serve): prefill candidates sorted by the requests the gateway currently has
in prefill on each node (its "active connections"), ties by node id. The gateway offers to
each in turn; a node accepts only while its batch has room, so no queue forms anywhere.
The decode node is the live one with the most free KV blocks that can hold the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from gateway.cluster import NodeState


class PlacementPolicy(Protocol):
    name: str

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]: ...

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None: ...


def blocks_for(node: NodeState, num_tokens: int) -> int:
    return -(-num_tokens // node.info.block_size)


class OnDemand:
    name = "on_demand"

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]:
        return sorted(nodes, key=lambda n: (len(n.in_prefill), n.node_id))

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None:
        fits = [
            n
            for n in nodes
            if n.node_id not in exclude and n.free_blocks >= blocks_for(n, prompt_len + 1)
        ]
        return max(fits, key=lambda n: (n.free_blocks, n.node_id), default=None)


POLICIES: dict[str, type] = {"on_demand": OnDemand}


def make_policy(name: str) -> PlacementPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {sorted(POLICIES)}")
    policy: PlacementPolicy = POLICIES[name]()
    return policy
