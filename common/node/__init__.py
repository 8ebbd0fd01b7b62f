"""What every node role shares: the runtime (runtime.py: one request table, one step loop,
one way to abort, the control plane of control.py), the role interface (role.py) with its
defaults (defaults.py) and where the node is (host.py)."""

from pdserve.common.node.control import ControlPlane, RegistrationRefused
from pdserve.common.node.defaults import RoleDefaults
from pdserve.common.node.host import (
    default_node_id,
    facing_address,
    host_identity,
    resolve_tokens_address,
)
from pdserve.common.node.role import NodeRequest, Role
from pdserve.common.node.runtime import NodeRuntime

__all__ = [
    "ControlPlane",
    "NodeRequest",
    "NodeRuntime",
    "RegistrationRefused",
    "Role",
    "RoleDefaults",
    "default_node_id",
    "facing_address",
    "host_identity",
    "resolve_tokens_address",
]
