"""Join the shortest queue (baseline): the prefill node with the fewest requests queued or
running (its last report, or what the gateway sent it since if more); decode: the node with
the fewest KV blocks in use. Prefill nodes queue locally."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.gateway.policies import register
from pdserve.gateway.policies.base import Need, NodeView, Policy, fits


@register
class JoinShortestQueue(Policy):
    name = "jsq"
    queueing = True

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        return sorted(nodes, key=lambda n: (n.queued, n.node_id))

    def pick_decode(self, nodes: Sequence[NodeView], need: Need) -> NodeView | None:
        return min(fits(nodes, need), key=lambda n: (n.blocks_in_use, n.node_id), default=None)
