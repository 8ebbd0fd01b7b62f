"""A node's KV data plane (prefill and decode nodes): one ZeroMQ data socket (ROUTER) with
the intake of KV that arrives, and one sender of KV that leaves.

What arrives: a decode node's requests from prefill nodes, and, on any node, prefix blocks it
fetched from a peer (`KvHeader.fetch`). What leaves: a prefill node's requests to decode
nodes, and prefix blocks a peer fetches from this node (`KvFetch`). The role handles its own
transfers through its hooks (`reserve_kv`, `admit_kv`, `kv_acked`, `kv_refused`); fetches,
either way, are `PrefixFetches`' (fetch.py), the same for every role.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from pdserve.common.config import NodeConfig
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.kv import listen_all, receivers_for
from pdserve.common.kv.base import Intake, Local, Transfer
from pdserve.common.kv.intake import KvIntake
from pdserve.common.kv.sender import KvSender
from pdserve.common.node.fetch import PrefixFetches, Promises, Wakes, free_and_wake
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.wire.address import host_port
from pdserve.common.wire.kv_messages import (
    KvHeader,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
)
from pdserve.common.wire.security import watch_handshakes
from pdserve.common.wire.transport import TOKENS_MAX_MSG, bound_address, make_socket


class KvHooks(Protocol):
    """The role's own transfers: KV arriving for its requests, KV it sent."""

    def reserve_kv(self, h: KvHeader) -> list[int] | str: ...
    async def admit_kv(self, intake: Intake, first_token: int) -> None: ...
    def kv_acked(self, t: Transfer) -> None: ...
    async def kv_refused(self, rid: str, peer: str, why: str) -> None: ...


class KvHost(Protocol):
    """What the data plane needs of its node: its sockets' context and key, its cache, and
    what it hands on to the prefix fetches (fetch.FetchHost)."""

    ctx: Any
    key: Any
    cfg: NodeConfig
    engine: Engine
    blocks: BlockManager
    scheduler: Scheduler
    node_id: str
    listen: str  # where its data sockets bind
    requests: dict[str, Any]
    token_cost: float
    metrics: NodeMetrics

    @property
    def steps(self) -> Wakes: ...
    @property
    def role(self) -> Promises: ...
    def spawn(self, coro: Any) -> None: ...
    def kv_local(self, data_address: str = "") -> Local: ...


class NodeKv:
    def __init__(self, node: KvHost, hooks: KvHooks) -> None:
        cfg, kv = node.cfg, node.engine.kv_store
        self.node, self.hooks = node, hooks
        max_frame = kv.frame_bytes(node.engine.max_model_len) + 4096
        self.data = make_socket(
            node.ctx,
            "node.data",
            f"tcp://{host_port(node.listen, cfg.data_port)}",
            max_msg=max(max_frame, TOKENS_MAX_MSG),
        )
        self.address = bound_address(self.data, cfg.advertise_host)
        local = node.kv_local(self.address)
        self.fetches = PrefixFetches(node, self)
        self.intake = KvIntake(
            self.data,
            kv,
            self._reserve,
            self._free,
            self._admit,
            receivers_for(local),
            timeout=cfg.kv_transfer_timeout,
            on_fetch=self.fetches.serve,
            vocab_size=node.engine.model_config.vocab_size,
            on_refused=self._refused_here,
        )
        self.sender = KvSender(
            node.ctx,
            local,
            on_ack=self._on_ack,
            on_refuse=self._on_refuse,
            on_stray_refuse=self.fetches.refused,
        )
        self.endpoints: dict[str, str] = {}

    def _free(self, blocks: list[int]) -> None:
        """An intake's reservation given back (dropped, stalled, refused)."""
        free_and_wake(self.node, blocks)

    def target(self) -> DecodeTarget:
        """How peers send KV here."""
        node = self.node
        return DecodeTarget(
            node_id=node.node_id,
            data_address=self.address,
            host_id=node.kv_local().host_id,
            kv_endpoints=self.endpoints,
        )

    async def start(self) -> list[asyncio.Task]:
        self.endpoints = await listen_all(self.intake.receivers, self.intake.landing)
        tasks = [asyncio.create_task(self.intake.run()), asyncio.create_task(self._expiry())]
        if self.node.key is not None:  # refused CurveZMQ peers show in the socket monitor
            tasks.append(asyncio.create_task(watch_handshakes(self.data, "node.data")))
        return tasks

    async def close(self) -> None:
        self.fetches.close()
        await self.sender.close()
        await self.intake.close()
        self.data.close()

    async def _expiry(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.intake.expire(time.monotonic())

    # -- dispatch: fetches here, the role's own transfers to the node ---------------------
    def _reserve(self, h: KvHeader) -> list[int] | str:
        return self.fetches.reserve(h) if h.fetch else self.hooks.reserve_kv(h)

    def _refused_here(self, h: KvHeader, peer: str, why: str) -> None:
        if h.fetch:  # ours: it computes its prefix now, not at its deadline
            self.fetches.refused(h.request_id, peer, why)

    async def _admit(self, intake: Intake, first_token: int) -> None:
        if intake.header.fetch:
            self.fetches.landed(intake)
        else:
            await self.hooks.admit_kv(intake, first_token)

    def _on_ack(self, t: Transfer) -> None:
        if not self.fetches.served(t.request_id, acked=True):
            self.hooks.kv_acked(t)

    async def _on_refuse(self, rid: str, peer: str, why: str) -> None:
        if not self.fetches.served(rid, acked=False):
            await self.hooks.kv_refused(rid, peer, why)
