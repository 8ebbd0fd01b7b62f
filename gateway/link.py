"""The gateway's sockets to the nodes: a ROUTER that nodes register, heartbeat and answer
offers on (control), and a PULL that decode nodes push token batches to (tokens)."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import zmq

from pdserve.common.config import GatewayConfig
from pdserve.common.wire.address import EVERYWHERE, bracket, host_port
from pdserve.common.wire.loop_socket import LoopSocket
from pdserve.common.wire.protocol import Msg, PrefillOffer
from pdserve.common.wire.security import ClusterKey, close_context, make_context
from pdserve.common.wire.transport import CONTROL_MAX_MSG, TOKENS_MAX_MSG, make_socket, send
from pdserve.gateway.cluster import NodeState

log = logging.getLogger("pdserve.gateway.core")


def new_gateway_id() -> str:
    """This process among several gateways (RegisterAck.gateway_id): new at every start, so a
    node tells a restarted gateway, which has lost its requests, from the one before; its
    start time first, so the lowest id, which leads the pool care, is the oldest gateway's
    (one just started knows no load yet: its rates start from nothing)."""
    return f"{time.time_ns():016x}{secrets.token_hex(3)}"


class NodeLink:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.ctx = make_context(ClusterKey.load(cfg.cluster_key) if cfg.cluster_key else None)
        # a wildcard: every interface, IPv4 and IPv6 (common/wire/transport.py)
        bind = EVERYWHERE if cfg.host in ("0.0.0.0", "::", "") else bracket(cfg.host)
        # read and written without pyzmq's future per message: the gateway's busiest sockets
        # (every node's heartbeats and token batches; common/wire/loop_socket.py)
        self.control = LoopSocket(make_socket(
            self.ctx, "gateway.control", f"tcp://{bind}:{cfg.control_port}",
            max_msg=CONTROL_MAX_MSG,
        ))  # fmt: skip
        self.tokens = LoopSocket(make_socket(
            self.ctx, "gateway.tokens", f"tcp://{bind}:{cfg.tokens_port}",
            max_msg=TOKENS_MAX_MSG,
        ))  # fmt: skip
        # an empty host tells each node to use the host it registered through (common/node/host.py)
        self.tokens_address = f"tcp://{host_port(cfg.advertise_host, cfg.tokens_port)}"
        self.gateway_id = new_gateway_id()

    async def send(self, node: NodeState, msg: Msg) -> None:
        try:
            await send(self.control, msg, to=node.identity)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): liveness will drop it
            log.warning("cannot reach %s: %s", node.node_id, _why(exc))

    async def offer(self, node: NodeState, offer: PrefillOffer) -> None:
        try:
            await send(self.control, offer, to=node.identity)
        except zmq.ZMQError as exc:  # peer gone: an OSError, so the placer tries the next node
            raise ConnectionError(f"cannot reach {node.node_id}: {exc}") from exc

    async def reply(self, identity: bytes, msg: Any) -> None:
        try:
            await send(self.control, msg, to=identity)
        except zmq.Again:
            log.warning("%s dropped: %s", type(msg).__name__, _why(zmq.Again()))
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY): liveness drops it
            log.info("no reply to a node that left (%s): %s", type(msg).__name__, exc)

    def close(self) -> None:
        self.control.close()
        self.tokens.close()
        close_context(self.ctx)


def _why(exc: zmq.ZMQError) -> str:
    if isinstance(exc, zmq.Again):  # sends never wait (common/wire/loop_socket.py)
        return "its control queue is full (1000 messages unread: a node not reading)"
    return str(exc)
