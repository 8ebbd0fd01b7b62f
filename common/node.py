"""What prefill and decode nodes share: registration, heartbeats, leases, drain, engine thread.

A node connects a DEALER (identity = node id + a random suffix) to the gateway's control
ROUTER, registers, and sends a heartbeat with its load every `heartbeat_interval`. The reply
names request ids the gateway no longer knows (the node frees them: leases) or says the
gateway does not know the node (it restarted): the node registers again. Engine work runs in
one dedicated thread so the event loop keeps answering offers and heartbeats during a
forward pass. SIGTERM drains: stop taking work, finish what is held (or hand it back after
`drain_timeout`), exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.errors import PdserveError
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
    encode,
)
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.transport import CONTROL_MAX_MSG, decode_or_none, make_socket, send

log = logging.getLogger(__name__)


class RegistrationRefused(PdserveError):
    pass


def default_node_id(role: str) -> str:
    """The compose container name (`pdserve-prefill-2`) in Docker, else ROLE-HOSTNAME-PID."""
    from pdserve.common.container import container_name

    return container_name() or f"{role}-{socket.gethostname()}-{os.getpid()}"


def _host_of(address: str) -> str:
    """`tcp://gateway:8001` -> `gateway`."""
    return address.split("://", 1)[1].rsplit(":", 1)[0]


def facing_address(gateway: str) -> str:
    """This host's address on the route to the gateway: what peers can reach us at when no
    --advertise-host is given (127.0.0.1 for a local gateway, the container's address on the
    compose network). A UDP connect sends nothing; it only asks the kernel for the route."""
    host = _host_of(gateway).strip("[]")
    if host in ("localhost", "127.0.0.1", "*", ""):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def resolve_tokens_address(address: str, gateway: str) -> str:
    """The gateway may leave its tokens host empty ("tcp://:8002"): then it is the host this
    node registered through, which is by construction one the node can reach."""
    if address.startswith("tcp://:"):
        return f"tcp://{_host_of(gateway)}:{address.rsplit(':', 1)[1]}"
    return address


def host_identity() -> str:
    """Equal exactly for processes that can share /dev/shm: the same kernel (boot id) and the
    same IPC namespace. Containers sharing an IPC namespace match; hostnames do not matter."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ipc_ns = os.readlink("/proc/self/ns/ipc")
    except OSError:
        return f"{socket.gethostname()}/{os.getpid()}"  # unknown: never share memory
    return f"{boot}/{ipc_ns}"


class NodeBase(ABC):
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
        self.ctx = zmq.asyncio.Context()
        self.control = make_socket(
            self.ctx,
            "node.control",
            cfg.gateway,
            identity=f"{self.node_id}/{secrets.token_hex(4)}",  # unique even for a duplicate id
            max_msg=CONTROL_MAX_MSG,
        )
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-engine")
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        self.draining = False
        self.refused = False  # the gateway refused us: the node id is not ours to deregister
        self.last_reply = time.monotonic()
        self.tokens_address = ""
        self.tasks: list[asyncio.Task] = []
        self.tokens_sock: zmq.asyncio.Socket | None = None
        self.background: set[asyncio.Future] = set()
        self.metrics = NodeMetrics(self.node_id, self.role, self.load, engine.num_blocks)
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
            dtype=self.ecfg.dtype if self.ecfg.engine == "torch" else "sim",
            tokenizer_fingerprint=self.tokenizer.fingerprint(),
            kv_layout=eng.model_config.layout_fingerprint(),
            block_size=eng.block_size,
            num_blocks=eng.num_blocks,
            max_batch=self.ecfg.max_batch,
            max_batch_tokens=self.ecfg.max_batch_tokens,
            max_model_len=eng.max_model_len,
            queueing=self.cfg.queueing,
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

    async def run_engine(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.begin_drain)
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
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.close_sockets()
        if self.tokens_sock is not None:
            self.tokens_sock.close()
        self.control.close()
        self.ctx.term()

    def close_sockets(self) -> None:
        """Close role-specific sockets (before the context terminates)."""
        return None

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
                    if unknown and not self.draining:
                        self.registered.clear()
                        await self.send_gateway(Register(info=self.info()))
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
            await self.send_gateway(Heartbeat(node_id=self.node_id, load=load))
            silent = time.monotonic() - self.last_reply
            if silent > self.cfg.heartbeat_timeout and not self.draining:
                # the gateway is gone or restarted: keep knocking until it answers
                self.registered.clear()
                await self.send_gateway(Register(info=self.info()))
                self.last_reply = time.monotonic()
