"""A gateway with prefill and decode nodes over real ZeroMQ sockets, all in one process and
one event loop: the harness of the component tests (sim engine, or the real SmolLM2 model with
one KV cache per node)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from aiohttp import web

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.common.node import NodeRuntime, RegistrationRefused, RoleDefaults
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.transport import free_port
from pdserve.gateway.app import CONFIG, SERVICE, errors_middleware
from pdserve.gateway.core import Gateway
from pdserve.gateway.requests import Done, Failed, GatewayRequest

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
SIM = EngineConfig(engine="sim", sim_time_scale=0.01, num_kv_blocks=256, max_batch=8)
TIMEOUT = 10.0


# -- helpers -------------------------------------------------------------------------------
async def until(pred: Callable[[], bool], timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or pred}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def http_front(gw: Gateway, routes: Iterable[web.RouteDef]) -> AsyncIterator[str]:
    """The gateway's handlers `routes` on a free port, as gateway/app.py serves them: the
    base URL while the context lasts."""
    app = web.Application(middlewares=[errors_middleware])
    app[CONFIG], app[SERVICE] = gw.cfg, gw.service
    app.add_routes(routes)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def outcome(req: GatewayRequest, timeout: float = TIMEOUT) -> Done | Failed:
    """The request's final event (Done or Failed); fails the test instead of hanging."""

    async def last() -> Done | Failed:
        while True:
            event = await req.events.get()
            if isinstance(event, Done | Failed):
                return event

    return await asyncio.wait_for(last(), timeout)


class Cluster:
    """A gateway on free ports and the nodes started on it; leaving the `async with` stops
    the nodes (each deregisters and closes its sockets), then the gateway."""

    def __init__(self, tokenizer: Any, **gateway: Any) -> None:
        self.tokenizer = tokenizer
        ports: set[int] = set()
        while len(ports) < 3:  # the HTTP port is unused here, but must differ
            ports.add(free_port())
        http, control, tokens = sorted(ports)
        cfg = GatewayConfig(port=http, control_port=control, tokens_port=tokens, **gateway)
        self.gw = Gateway(cfg, tokenizer)
        self.address = f"tcp://127.0.0.1:{control}"
        self.tasks: dict[str, tuple[NodeRuntime, asyncio.Task]] = {}
        self.count = 0

    async def __aenter__(self) -> Cluster:
        await self.gw.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for node, task in list(self.tasks.values()):
            await self.stop(node, task)
        await self.gw.stop()

    def node(
        self,
        role: type[RoleDefaults],
        node_id: str,
        ecfg: EngineConfig = SIM,
        engine: Any = None,
        **cfg: Any,
    ) -> Any:
        # cfg may name other gateways too (several gateways: "ADDR1,ADDR2")
        ncfg = NodeConfig(**{"gateway": self.address, "node_id": node_id,
                             "heartbeat_interval": 0.1, **cfg})  # fmt: skip
        engine = engine if engine is not None else SimEngine(ecfg)
        return NodeRuntime(role, ncfg, ecfg, engine, self.tokenizer)

    def start(self, node: NodeRuntime) -> asyncio.Task:
        task = asyncio.create_task(node.serve())
        self.count += 1
        self.tasks[f"{node.node_id}#{self.count}"] = (node, task)
        return task

    async def add(self, node: NodeRuntime) -> Any:
        """Start the node and wait until the gateway acknowledged it."""
        task = self.start(node)
        await asyncio.wait_for(node.registered.wait(), TIMEOUT)
        assert not task.done()
        return node

    async def stop(self, node: NodeRuntime, task: asyncio.Task) -> None:
        node.stopped.set()
        try:
            await asyncio.wait_for(task, TIMEOUT)
        except RegistrationRefused:
            pass
        self.tasks = {k: v for k, v in self.tasks.items() if v[1] is not task}
        # a stopped node leaves no loop of its own running (on closed sockets)
        await until(lambda: not tasks_of(*node.parts()), 1.0, f"{node.node_id}'s tasks to end")

    def request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams = PARAMS
    ) -> GatewayRequest:
        return GatewayRequest(
            request_id=rid,
            kind="completion",
            model="m",
            prompt_ids=prompt_ids,
            params=params,
            stream=True,
            include_usage=False,
            tokenizer=self.tokenizer,
        )


def tasks_of(*objs: object) -> list[str]:
    """Names of the pending tasks running a method of one of `objs`."""
    names = []
    for task in asyncio.all_tasks():
        frame = getattr(task.get_coro(), "cr_frame", None)
        if (
            not task.done()
            and frame is not None
            and any(frame.f_locals.get("self") is obj for obj in objs if obj is not None)
        ):
            names.append(task.get_coro().__qualname__)
    return names


SIM_VOCAB = 128_256  # the sim profiles' vocabulary (Llama 3.1's): nodes refuse ids past it


def prompt(n: int, start: int = 1000) -> list[int]:
    """`n` token ids from `start` on (wrapped into the vocabulary: distinct starts give
    distinct prompts, whatever their number)."""
    return [t % SIM_VOCAB for t in range(start, start + n)]


def own_cache(runner: Any) -> Any:
    """The runner's weights with a KV cache of its own (another node's engine)."""
    from pdserve.common.engine.kv_cache import KVCache

    other = copy.copy(runner)
    mc = runner.model_config
    other.kv_cache = KVCache(
        mc.num_layers,
        runner.num_blocks,
        runner.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        runner.dtype,
    )
    return other


def digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).numpy().tobytes()).hexdigest()
