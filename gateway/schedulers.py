"""Placement policies: which prefill nodes to offer a request to, in what order, and which
decode node receives its KV. Pure: they read the cluster view and return decisions.

`on_demand` (P/D-Serve, the default): prefill candidates sorted by the requests the gateway
currently has in prefill on each node (its "active connections"), ties by node id. The
gateway offers to each in turn; a node accepts only while its batch has room, so no queue
forms anywhere. Decode: the live node with the most free KV blocks that can hold the request.

The baselines pick one prefill node and let it queue (their prefill nodes run with
`--queueing`, accepting every offer, exactly as the systems they stand for do):

`round_robin` - prefill and decode nodes in turn.
`jsq`         - join the shortest queue: the prefill node with the fewest requests queued or
                running (its heartbeat, plus what the gateway sent since); decode: the node
                with the fewest KV blocks in use.
`kv_aware`    - Mooncake-style: estimated TTFT per prefill node =
                    queue wait    (modelled prefill time of the prompt tokens already queued)
                  + prefill time  of this prompt's tokens not cached there
                  + KV transfer   time of the prompt's KV
                with the cost model of `--sim-profile`; the least wins. Without a prefix index
                of the node's cache the estimate is cache-blind (nothing counts as cached).
                Decode: the most free KV blocks. Each decision is logged with its numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from pdserve.common.costmodel import CostModel
from pdserve.gateway.cluster import NodeState

log = logging.getLogger(__name__)


class PlacementPolicy(Protocol):
    name: str
    queueing: bool  # do its prefill nodes queue locally?

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]: ...

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None: ...


def blocks_for(node: NodeState, num_tokens: int) -> int:
    return -(-num_tokens // node.info.block_size)


def _fits(nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]) -> list[NodeState]:
    return [
        n
        for n in nodes
        if n.node_id not in exclude and n.free_blocks >= blocks_for(n, prompt_len + 1)
    ]


def most_free(nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]) -> NodeState | None:
    """Most free KV blocks; ties to the node given the fewest requests so far."""
    return max(
        _fits(nodes, prompt_len, exclude),
        key=lambda n: (n.free_blocks, -n.assigned, n.node_id),
        default=None,
    )


class OnDemand:
    name = "on_demand"
    queueing = False

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]:
        # ties (e.g. every node idle) go to the node that accepted least so far, so a
        # trickle of requests still spreads over the pool instead of always hitting one
        return sorted(nodes, key=lambda n: (len(n.in_prefill), n.accepts, n.node_id))

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None:
        return most_free(nodes, prompt_len, exclude)


class RoundRobin:
    name = "round_robin"
    queueing = True

    def __init__(self) -> None:
        self.next_prefill = 0
        self.next_decode = 0

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]:
        ordered = sorted(nodes, key=lambda n: n.node_id)
        if not ordered:
            return []
        start = self.next_prefill % len(ordered)
        self.next_prefill += 1
        return ordered[start:] + ordered[:start]  # the rest only if the chosen one refuses

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None:
        ordered = sorted(_fits(nodes, prompt_len, exclude), key=lambda n: n.node_id)
        if not ordered:
            return None
        self.next_decode += 1
        return ordered[(self.next_decode - 1) % len(ordered)]


def queued(node: NodeState) -> int:
    """Requests waiting or running at a prefill node: its last report, or what the gateway
    sent it since if more (reports lag by up to a heartbeat)."""
    return max(node.load.waiting + node.load.running, len(node.in_prefill))


class JoinShortestQueue:
    name = "jsq"
    queueing = True

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]:
        return sorted(nodes, key=lambda n: (queued(n), n.node_id))

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None:
        fits = _fits(nodes, prompt_len, exclude)
        return min(
            fits, key=lambda n: (n.load.blocks_in_use + n.reserved_blocks, n.node_id), default=None
        )


class KvAware:
    name = "kv_aware"
    queueing = True

    def __init__(self, profile: str = "h100-llama3.1-8b") -> None:
        self.cost = CostModel.named(profile)

    def estimate(self, node: NodeState, prompt_len: int, cached: int = 0) -> dict[str, float]:
        wait = sum(self.cost.prefill_seconds(n) for n in node.in_prefill.values())
        prefill = self.cost.prefill_seconds(prompt_len - cached, cached)
        transfer = self.cost.transfer_seconds(prompt_len)
        return {
            "queue_s": wait,
            "prefill_s": prefill,
            "transfer_s": transfer,
            "ttft_s": wait + prefill + transfer,
            "cached_tokens": cached,
        }

    def prefill_order(self, nodes: Iterable[NodeState], prompt_len: int) -> list[NodeState]:
        scored = [(self.estimate(n, prompt_len), n) for n in nodes]
        scored.sort(key=lambda pair: (pair[0]["ttft_s"], pair[1].node_id))
        if scored and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kv_aware %d tokens: %s",
                prompt_len,
                {n.node_id: {k: round(v, 4) for k, v in e.items()} for e, n in scored},
            )
        return [n for _, n in scored]

    def pick_decode(
        self, nodes: Iterable[NodeState], prompt_len: int, exclude: set[str]
    ) -> NodeState | None:
        return most_free(nodes, prompt_len, exclude)


POLICIES = ("on_demand", "round_robin", "jsq", "kv_aware")


def make_policy(name: str, profile: str = "h100-llama3.1-8b") -> PlacementPolicy:
    if name == "on_demand":
        return OnDemand()
    if name == "round_robin":
        return RoundRobin()
    if name == "jsq":
        return JoinShortestQueue()
    if name == "kv_aware":
        return KvAware(profile)
    raise ValueError(f"unknown scheduler {name!r}: choose one of {sorted(POLICIES)}")
