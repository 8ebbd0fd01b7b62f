"""One node process, more than one role over its life (live role switching).

The gateway may ask a node to take the other role (`SwitchRole`, gateway/roles.py). The node
drains as for SIGTERM (a prefill node finishes its batch and hands the KV on; a decode node
moves its sequences with their KV to other decode nodes), deregisters and leaves its serving
loop with `switch_to` set; `serve_roles` then builds the other role's node on the same engine
(the weights and the KV cache memory stay: no reload) and serves it. A signal during the
switch stops the process instead (`ControlPlane.on_signal`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.common.node.runtime import NodeRuntime

log = logging.getLogger(__name__)


async def serve_roles(role: str, make: Callable[[str], NodeRuntime]) -> None:
    """Serve `make(role)`, then each role it is switched to, until it stops for good."""
    while True:
        node = make(role)
        await node.serve()
        switch_to = node.control.switch_to
        if switch_to is None:
            return
        log.info("%s: %s -> %s, engine kept", node.node_id, role, switch_to)
        role = switch_to
