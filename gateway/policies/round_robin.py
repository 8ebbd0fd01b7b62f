"""Round robin (baseline): prefill and decode nodes in turn, whatever their load; prefill
nodes queue locally, as the systems this stands for do. The other prefill nodes follow in
the order only if the chosen one cannot take the request at all."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.costmodel import CostModel
from pdserve.gateway.policies import register
from pdserve.gateway.policies.base import Need, NodeView, Policy, fits


@register
class RoundRobin(Policy):
    name = "round_robin"
    queueing = True

    def __init__(self, cost: CostModel, decode_fit: str = "spread") -> None:
        super().__init__(cost, decode_fit)
        self.next_prefill = 0
        self.next_decode = 0

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        ordered = sorted(nodes, key=lambda n: n.node_id)
        if not ordered:
            return []
        start = self.next_prefill % len(ordered)
        self.next_prefill += 1
        return ordered[start:] + ordered[:start]

    def pick_decode(self, nodes: Sequence[NodeView], need: Need) -> NodeView | None:
        ordered = sorted(fits(nodes, need), key=lambda n: n.node_id)
        if not ordered:
            return None
        self.next_decode += 1
        return ordered[(self.next_decode - 1) % len(ordered)]
