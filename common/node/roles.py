"""One node process, more than one role over its life (live role switching).

The gateway may ask a node to take the other role (`SwitchRole`, gateway/roles.py). The node
drains as for SIGTERM (a prefill node finishes its batch and hands the KV on; a decode node
moves its sequences with their KV to other decode nodes), deregisters and leaves its serving
loop with `switch_to` set; `serve_roles` then builds the other role's node on the same engine
(the weights and the KV cache memory stay: no reload) and serves it. A signal during the
switch, at any moment of it, ends the process in a drain instead (`serve_roles`,
`ControlPlane.on_signal`); a `SwitchRole` to a node already draining is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from pdserve.common.node.runtime import NodeRuntime

log = logging.getLogger(__name__)


async def serve_roles(role: str, make: Callable[[str], NodeRuntime]) -> None:
    """Serve `make(role)`, then each role it is switched to, until it stops for good.

    SIGTERM and SIGINT have one handler for the process's life, handing each to the role of
    the moment: the old one until the new one is built (a signal as it drains or shuts down
    clears its switch: the process exits), then the new one (signalled before it registers,
    it drains at once and registers with no gateway). A handler per role left the old one's
    answering while the new one started: a signal it took then, the switch read, was lost."""
    node = make(role)

    def on_signal() -> None:
        node.control.on_signal()  # `node`: the role of the moment (rebound below)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, on_signal)
    while True:
        await node.serve()
        switch_to = node.control.switch_to
        if switch_to is None:
            return
        log.info("%s: %s -> %s, engine kept", node.node_id, role, switch_to)
        role = switch_to
        node = make(role)  # no await since the old role's end: no signal falls between
