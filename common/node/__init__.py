"""What every node role shares: the control plane (control.py: registration, heartbeats,
leases, drain), the runtime (runtime.py: one request table, one step loop, one way to abort)
and where the node is (host.py)."""

from pdserve.common.node.control import NodeControl, RegistrationRefused
from pdserve.common.node.host import (
    default_node_id,
    facing_address,
    host_identity,
    resolve_tokens_address,
)
from pdserve.common.node.runtime import NodeBase, NodeRequest

__all__ = [
    "NodeBase",
    "NodeControl",
    "NodeRequest",
    "RegistrationRefused",
    "default_node_id",
    "facing_address",
    "host_identity",
    "resolve_tokens_address",
]
