"""On-demand forwarding (P/D-Serve), the default: no queue at the gateway or the nodes.

Prefill candidates are offered the request in order of the requests the gateway currently has
in prefill on each (its "active connections"); each node accepts only while its batch has
room, so no queue forms anywhere. Ties (every node idle, say) go to the node that accepted
least so far, so a trickle of requests still spreads over the pool instead of always hitting
one. Decode: the node with the most free KV blocks that can hold the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.gateway.policies import register
from pdserve.gateway.policies.base import Need, NodeView, Policy


@register
class OnDemand(Policy):
    name = "on_demand"
    queueing = False

    def prefill_order(self, nodes: Sequence[NodeView], need: Need) -> list[NodeView]:
        return sorted(nodes, key=lambda n: (len(n.in_prefill), n.node.accepts, n.node_id))
