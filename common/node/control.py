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
import dataclasses
import logging
import secrets
import signal
import time
from abc import ABC, abstractmethod
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.errors import PdserveError
from pdserve.common.node.host import (
    default_node_id,
    facing_address,
    host_identity,
    resolve_tokens_address,
)
from pdserve.common.node_metrics import NodeMetrics, start_http
from pdserve.common.protocol import (
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
    Role,
    SwitchRole,
    encode,
)
from pdserve.common.security import ClusterKey, close_context, make_context
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import CONTROL_MAX_MSG, decode_or_none, make_socket, send

log = logging.getLogger(__name__)


class RegistrationRefused(PdserveError):
    pass


class NodeControl(ABC):
    role: Role
    pushes_tokens = False  # decode and colocated nodes stream tokens to the gateway

    def __init__(
        self, cfg: NodeConfig, ecfg: EngineConfig, engine: Engine, tokenizer: Tokenizer
    ) -> None:
        if not cfg.advertise_host:
            cfg = dataclasses.replace(cfg, advertise_host=facing_address(cfg.gateway))
        self.cfg = cfg
        self.ecfg = ecfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.node_id = cfg.node_id or default_node_id(self.role)
        self.key = ClusterKey.load(cfg.cluster_key) if cfg.cluster_key else None
        if self.key is not None and cfg.kv_backend == "ucx":
            log.warning("--kv-backend ucx: KV over UCX is not authenticated by --cluster-key")
        self.ctx = make_context(self.key)
        self.control = make_socket(
            self.ctx,
            "node.control",
            cfg.gateway,
            identity=f"{self.node_id}/{secrets.token_hex(4)}",  # unique even for a duplicate id
            max_msg=CONTROL_MAX_MSG,
        )
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        self.draining = False
        self.refused = False  # the gateway refused us: the node id is not ours to deregister
        self.switch_to: str | None = None  # the role to take once drained (SwitchRole)
        self.last_reply = time.monotonic()
        self.tokens_address = ""
        self.tasks: list[asyncio.Task] = []
        self.tokens_sock: zmq.asyncio.Socket | None = None
        self.background: set[asyncio.Future] = set()
        self.metrics = NodeMetrics(self.node_id, self.role, self.load, engine.num_blocks)
        self.metrics.engine_info(ecfg.dtype, ecfg.quantization, engine.kernels)
        self.http: Any = None

    # -- to implement ----------------------------------------------------------------------
    @abstractmethod
    def data_address(self) -> str: ...

    @abstractmethod
    def load(self) -> Load: ...

    @abstractmethod
    async def on_gateway_message(self, msg: Any) -> None: ...

    @abstractmethod
    def free_stale(self, request_ids: tuple[str, ...]) -> None: ...

    @abstractmethod
    def idle(self) -> bool:
        """Nothing held: a draining node may exit."""

    def on_registered(self, ack: RegisterAck) -> None:
        """The gateway accepted us and said how to take work (a role applies what it needs)."""
        return None

    def on_kv_resync(self) -> None:
        """The gateway lost track of our prefix cache: publish it whole next time."""
        return None

    def kv_seq(self) -> int:
        """The seq of the last KvEvents sent (-1: none)."""
        return -1

    async def publish(self) -> None:
        """Called after each heartbeat: send what the gateway should know beside the load."""
        return None

    async def on_drain_timeout(self) -> None:
        """Hand back whatever is still held when the drain timeout passes."""
        return None

    # -- shared ----------------------------------------------------------------------------
    def info(self) -> NodeInfo:
        eng = self.engine
        return NodeInfo(
            node_id=self.node_id,
            role=self.role,
            data_address=self.data_address(),
            host_id=host_identity(),
            model_id=getattr(eng, "model_id", "unknown"),
            dtype=self.ecfg.numerics,  # "bfloat16", "bfloat16+int4", "sim": must match
            tokenizer_fingerprint=self.tokenizer.fingerprint(),
            kv_layout=eng.model_config.layout_fingerprint(),
            block_size=eng.block_size,
            num_blocks=eng.num_blocks,
            max_batch=self.ecfg.max_batch,
            max_batch_tokens=self.ecfg.max_batch_tokens,
            max_model_len=eng.max_model_len,
        )

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

    async def send_gateway(self, msg: Msg) -> None:
        await send(self.control, msg)

    def spawn(self, coro: Any) -> None:
        """Fire and forget, keeping a reference so the task is not collected mid-flight."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.on_signal)
        self.tasks += [  # += : the role's own loops, added before this, are cancelled too
            asyncio.create_task(self._control_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]
        for task in self.tasks:
            task.add_done_callback(self._task_ended)
        if self.cfg.metrics_port:
            self.http = await start_http(
                self.metrics, self.health, self.cfg.metrics_host, self.cfg.metrics_port
            )
        await self.send_gateway(Register(info=self.info()))
        try:
            await self.stopped.wait()
            for task in self.tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await self.shutdown()

    def _task_ended(self, task: asyncio.Task) -> None:
        """A loop that dies must take the node down: a node that heartbeats while its engine
        loop is dead would be offered work forever. Exiting lets the gateway re-place its
        requests and a supervisor (compose `restart`) start it again."""
        if task.cancelled() or task.exception() is None:
            return
        if not isinstance(task.exception(), RegistrationRefused):  # that one is logged already
            log.error("%s: a node loop failed; stopping", self.node_id, exc_info=task.exception())
        self.stopped.set()

    async def shutdown(self) -> None:
        if not self.refused:
            with contextlib.suppress(zmq.ZMQError):
                await asyncio.wait_for(self.send_gateway(Deregister(node_id=self.node_id)), 0.5)
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.http is not None:
            await self.http.cleanup()
        await self.close_role()
        if self.tokens_sock is not None:
            self.tokens_sock.close()
        self.control.close()
        close_context(self.ctx)

    async def close_role(self) -> None:
        """Stop what the role runs beside the control plane (before the context ends)."""
        return None

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

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        while not self.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.idle():
            await self.on_drain_timeout()
        self.stopped.set()

    async def _control_loop(self) -> None:
        while True:
            payload = await self.control.recv()
            msg = decode_or_none(GATEWAY_DECODER, payload)
            self.last_reply = time.monotonic()
            match msg:
                case RegisterAck(tokens_address=address):
                    self.on_registered(msg)
                    self.tokens_address = resolve_tokens_address(address, self.cfg.gateway)
                    self.registered.set()
                    log.info("%s registered", self.node_id)
                    if self.pushes_tokens and self.tokens_sock is None:
                        self.tokens_sock = make_socket(
                            self.ctx, "decode.tokens", self.tokens_address
                        )
                case RegisterRefuse(reason=reason):
                    log.error("gateway refused %s: %s", self.node_id, reason)
                    self.refused = True
                    self.stopped.set()
                    raise RegistrationRefused(reason)
                case HeartbeatReply(stale=stale, unknown_node=unknown):
                    if stale:
                        self.free_stale(stale)
                    if msg.kv_resync:
                        self.on_kv_resync()
                    if unknown and not self.draining:
                        self.registered.clear()
                        await self.send_gateway(Register(info=self.info()))
                case SwitchRole(role=role) if role != self.role and not self.draining:
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
                        await self.on_gateway_message(msg)
                    except Exception:
                        log.exception("handling %s failed", type(msg).__name__)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval)
            load = self.load()
            await self.send_gateway(
                Heartbeat(node_id=self.node_id, load=load, kv_seq=self.kv_seq())
            )
            if self.registered.is_set():
                await self.publish()
            silent = time.monotonic() - self.last_reply
            if silent > self.cfg.heartbeat_timeout and not self.draining:
                # the gateway is gone or restarted: keep knocking until it answers
                self.registered.clear()
                await self.send_gateway(Register(info=self.info()))
                self.last_reply = time.monotonic()
