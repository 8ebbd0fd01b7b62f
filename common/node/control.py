"""A node's control plane, the same for every role: registration, heartbeats, leases, drain.

A node connects a DEALER (identity = node id + a random suffix) to the gateway's control
ROUTER, registers, and sends a heartbeat with its load every `heartbeat_interval`. The reply
names request ids the gateway no longer knows (the node frees them: leases) or says the
gateway does not know the node (it restarted): the node registers again. SIGTERM drains:
stop taking work, finish what is held (or hand it back after `drain_timeout`), exit. A loop
that dies takes the node down, so that a supervisor restarts it rather than the gateway
offering work to a node that cannot do it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
from typing import Any, Protocol

import zmq
import zmq.asyncio

from pdserve.common.config import NodeConfig
from pdserve.common.errors import PdserveError
from pdserve.common.node.events import PrefixEvents
from pdserve.common.node.host import resolve_tokens_address
from pdserve.common.node_metrics import NodeMetrics, start_http
from pdserve.common.wire.protocol import (
    GATEWAY_DECODER,
    Deregister,
    Heartbeat,
    HeartbeatReply,
    Load,
    Msg,
    NodeInfo,
    Register,
    RegisterAck,
    RegisterRefuse,
    SwitchRole,
    encode,
)
from pdserve.common.wire.transport import CONTROL_MAX_MSG, decode_or_none, make_socket, send

log = logging.getLogger(__name__)


class RegistrationRefused(PdserveError):
    pass


class NodeState(Protocol):
    """What the control plane reports of the node and asks of it."""

    def info(self) -> NodeInfo: ...
    def load(self) -> Load: ...
    def idle(self) -> bool: ...  # nothing held: a draining node may exit
    def free_stale(self, request_ids: tuple[str, ...]) -> None: ...


class RoleMessages(Protocol):
    """The role's part: the gateway's other messages, and what a drain leaves behind."""

    role: str
    pushes_tokens: bool  # decode and colocated nodes stream tokens to the gateway

    def on_registered(self, ack: RegisterAck) -> None: ...
    async def on_gateway_message(self, msg: Any) -> None: ...
    async def on_drain_timeout(self) -> None: ...
    def on_drain(self) -> None: ...


class ControlPlane:
    def __init__(
        self,
        cfg: NodeConfig,
        node_id: str,
        ctx: Any,
        node: NodeState,
        role: RoleMessages,
        events: PrefixEvents,
        metrics: NodeMetrics,
    ) -> None:
        self.cfg, self.node_id, self.ctx = cfg, node_id, ctx
        self.node, self.role, self.events, self.metrics = node, role, events, metrics
        self.control = make_socket(
            ctx, "node.control", cfg.gateway,
            identity=f"{node_id}/{secrets.token_hex(4)}",  # unique even for a duplicate id
            max_msg=CONTROL_MAX_MSG,
        )  # fmt: skip
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        self.draining = False
        self.refused = False  # the gateway refused us: the node id is not ours to deregister
        self.switch_to: str | None = None  # the role to take once drained (SwitchRole)
        self.last_reply = time.monotonic()
        self.tokens_address = ""
        self.tokens_sock: Any = None
        self.tasks: list[asyncio.Task] = []
        self.http: Any = None

    async def push_tokens(self, msg: Msg) -> None:
        """Token batches and preemptions go to the gateway's PULL socket (decode, colocated)."""
        await self.registered.wait()
        assert self.tokens_sock is not None
        await self.tokens_sock.send(encode(msg))

    def health(self) -> str | None:
        """None while serving (registered, not draining), else why not: /health."""
        if self.draining:
            return "draining"
        if not self.registered.is_set():
            return f"not registered with the gateway at {self.cfg.gateway}"
        return None

    async def send(self, msg: Msg) -> None:
        await send(self.control, msg)

    async def start(self, role_tasks: list[asyncio.Task]) -> None:
        """Signals, the control loops and /metrics; then register. The role's own loops
        are watched with them: any one that dies stops the node."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.on_signal)
        self.tasks += [
            *role_tasks,
            asyncio.create_task(self._control_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]
        for task in self.tasks:
            task.add_done_callback(self._task_ended)
        if self.cfg.metrics_port:
            self.http = await start_http(
                self.metrics, self.health, self.cfg.metrics_host, self.cfg.metrics_port
            )
        await self.send(Register(info=self.node.info()))

    async def wait_stopped(self) -> None:
        await self.stopped.wait()
        for task in self.tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _task_ended(self, task: asyncio.Task) -> None:
        """A loop that dies must take the node down: a node that heartbeats while its engine
        loop is dead would be offered work forever. Exiting lets the gateway re-place its
        requests and a supervisor (compose `restart`) start it again."""
        if task.cancelled() or task.exception() is None:
            return
        if not isinstance(task.exception(), RegistrationRefused):  # that one is logged already
            log.error("%s: a node loop failed; stopping", self.node_id, exc_info=task.exception())
        self.stopped.set()

    async def stop(self) -> None:
        """Deregister and end the loops (the role's included)."""
        if not self.refused:
            with contextlib.suppress(zmq.ZMQError):
                await asyncio.wait_for(self.send(Deregister(node_id=self.node_id)), 0.5)
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.http is not None:
            await self.http.cleanup()

    def close(self) -> None:
        if self.tokens_sock is not None:
            self.tokens_sock.close()
        self.control.close()

    def on_signal(self) -> None:
        """SIGTERM or SIGINT: drain and exit, a role switch under way included."""
        self.switch_to = None
        self.begin_drain()

    def begin_drain(self) -> None:
        if self.draining:
            self.stopped.set()  # a second signal: stop now
            return
        log.info("%s draining", self.node_id)
        self.draining = True
        self.tasks.append(asyncio.create_task(self._drain()))
        self.role.on_drain()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        while not self.node.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.node.idle():
            await self.role.on_drain_timeout()
        self.stopped.set()

    async def _control_loop(self) -> None:
        while True:
            payload = await self.control.recv()
            msg = decode_or_none(GATEWAY_DECODER, payload)
            self.last_reply = time.monotonic()
            match msg:
                case RegisterAck(tokens_address=address):
                    self._registered(msg, address)
                case RegisterRefuse(reason=reason):
                    log.error("gateway refused %s: %s", self.node_id, reason)
                    self.refused = True
                    self.stopped.set()
                    raise RegistrationRefused(reason)
                case HeartbeatReply(stale=stale, unknown_node=unknown):
                    if stale:
                        self.node.free_stale(stale)
                    if msg.kv_resync:
                        self.events.resync()
                    if unknown and not self.draining:
                        self.registered.clear()
                        await self.send(Register(info=self.node.info()))
                case SwitchRole(role=role) if role != self.role.role and not self.draining:
                    # the other role in this process: drain as for SIGTERM, then the serving
                    # loop (common/node/roles.py) starts the other role's node on the engine
                    log.info("%s switching to %s", self.node_id, role)
                    self.switch_to = role
                    self.begin_drain()
                case SwitchRole():
                    log.info("%s: role switch ignored (draining, or that role)", self.node_id)
                case None:
                    log.warning("dropping malformed message from the gateway")
                case _:
                    try:
                        await self.role.on_gateway_message(msg)
                    except Exception:
                        log.exception("handling %s failed", type(msg).__name__)

    def _registered(self, ack: RegisterAck, address: str) -> None:
        self.events.resync()  # a new gateway, or one that dropped us
        self.role.on_registered(ack)
        self.tokens_address = resolve_tokens_address(address, self.cfg.gateway)
        self.registered.set()
        log.info("%s registered", self.node_id)
        if self.role.pushes_tokens and self.tokens_sock is None:
            self.tokens_sock = make_socket(self.ctx, "decode.tokens", self.tokens_address)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval)
            load = self.node.load()
            await self.send(Heartbeat(node_id=self.node_id, load=load, kv_seq=self.events.seq()))
            if self.registered.is_set():
                await self.events.publish()
            silent = time.monotonic() - self.last_reply
            if silent > self.cfg.heartbeat_timeout and not self.draining:
                # the gateway is gone or restarted: keep knocking until it answers
                self.registered.clear()
                await self.send(Register(info=self.node.info()))
                self.last_reply = time.monotonic()
