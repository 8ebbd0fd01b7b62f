"""What a placement policy sees and decides. Pure: policies read `NodeView`s and return an
order; no sockets, no clocks.

A policy answers two questions for a request that needs `Need.prompt_len` tokens prefilled:
in which order to offer it to prefill nodes (`prefill_order`), and which decode node takes its
KV (`pick_decode`). The gateway turns the answers into a plan (gateway/plan.py) and runs the
offer protocol over it. `queueing` says whether the policy's prefill nodes keep a local queue
(the baselines) or answer offers by batch room (on-demand); the gateway tells every prefill
node at registration.

A new policy is one module in this package: subclass `Policy`, decorate it with `@register`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.common.costmodel import CostModel
from pdserve.gateway.cluster import NodeState


@dataclass(frozen=True)
class NodeView:
    """One node as a policy sees it, derived at decision time from its last load report and
    the gateway's request table."""

    node: NodeState
    in_prefill: tuple[int, ...] = ()  # prompt tokens of each request the gateway has in
    # prefill here (what it sent since the node's report counts too)
    decoding: int = 0  # requests whose KV is on, or headed to, this node
    free_blocks: int = 0  # reported free + cached, minus what was promised since
    cached: int = 0  # of this request's leading blocks, how many its cache holds (the index)
    # prefill: another node holding more of them (`holder_blocks`), which this node may fetch
    holder: NodeState | None = None
    holder_blocks: int = 0

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def block_size(self) -> int:
        return self.node.info.block_size

    @property
    def cached_tokens(self) -> int:
        return self.cached * self.block_size

    @property
    def fetchable_tokens(self) -> int:
        """Tokens beyond its own cached prefix this node could fetch from `holder`."""
        return max(0, self.holder_blocks - self.cached) * self.block_size

    @property
    def queued(self) -> int:
        """Requests waiting or running at a prefill node: its last report, or what the gateway
        sent it since if more (reports lag by up to a heartbeat)."""
        return max(self.node.load.waiting + self.node.load.running, len(self.in_prefill))

    @property
    def blocks_in_use(self) -> int:
        return self.node.load.blocks_in_use + (self.node.load.blocks_free - self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class Need:
    prompt_len: int  # tokens to prefill (prompt, or prompt + output kept when re-placed)
    exclude_decode: frozenset[str] = field(default_factory=frozenset)  # refused the KV
    hashes: tuple[bytes, ...] = ()  # chained hashes of its full blocks (common/prefix.py)


class Policy:
    name: ClassVar[str]
    queueing: ClassVar[bool] = False  # do its prefill nodes queue locally?

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost  # the cost model of --cost-profile, for policies that estimate

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        raise NotImplementedError

    def pick_decode(self, nodes: Sequence[NodeView], need: Need) -> NodeView | None:
        """Default: among nodes that can hold the request, the one whose cache holds the most
        of its prefix (a conversation's earlier turns: their KV need not travel again), then
        the one with the most free KV blocks."""
        return max(
            fits(nodes, need),
            key=lambda n: (n.cached, n.free_blocks, -n.decoding, n.node_id),
            default=None,
        )


def fits(nodes: Iterable[NodeView], need: Need) -> list[NodeView]:
    """Decode nodes not excluded with room for the prompt's KV and the first token."""
    return [
        n
        for n in nodes
        if n.node_id not in need.exclude_decode
        and n.free_blocks >= n.blocks_for(need.prompt_len + 1)
    ]
