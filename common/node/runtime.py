"""The node runtime every role runs on: one request table, one step loop, one way to abort,
one control plane; the role (common/node/role.py) is plugged in.

    ControlPlane   registration, heartbeats, leases, drain (control.py)
    StepLoop       schedule, before/engine/after step of the role (steps.py)
    PrefixEvents   the prefix cache as the gateway's index sees it (events.py)
    NodeKv         the KV data plane: intake, sender, prefix fetches (kv.py; prefill, decode)

`requests` holds every request the node has (by wire id) from the moment it takes it until
it lets go: a prefill node from its Accept until the decode node acknowledged the KV, a
decode node from the KV's arrival (its intake holds it before that) until the last token, a
colocated node from Accept to last token. Each entry is the engine `Sequence` (tokens, KV
blocks, scheduling state, in `scheduler`) plus what the role needs beside it.

Aborts (client gone, lease expired, stop string) go through `abort` alone: a request the
running step is computing is dropped right after the step; any other at once. Dropping frees
its blocks wherever the scheduler holds it (waiting, running, parked) and lets the role let
go of the rest (`on_dropped`: a KV transfer, an intake).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.tiers import TierStore, sweep_dead_tiers
from pdserve.common.kv.base import Local
from pdserve.common.kv.intake import KvIntake
from pdserve.common.kv.sender import KvSender
from pdserve.common.model.cache import cache_dir
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.node.adoption import GIVEN_BACK
from pdserve.common.node.control import ControlPlane
from pdserve.common.node.events import PrefixEvents
from pdserve.common.node.host import default_node_id, facing_address, host_identity
from pdserve.common.node.kv import NodeKv
from pdserve.common.node.role import NodeRequest, Role
from pdserve.common.node.steps import StepLoop
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.wire.address import EVERYWHERE
from pdserve.common.wire.protocol import (
    NODE_FEATURES,
    Foreign,
    Load,
    Msg,
    NodeInfo,
    Preempted,
    TokenBatch,
)
from pdserve.common.wire.security import ClusterKey, close_context, make_context
from pdserve.common.wire.transport import listen_host

log = logging.getLogger(__name__)
# an engine's own context limit, before a role fitted it to its cache (role switches)
_OWN_LIMIT: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class NodeRuntime:
    def __init__(
        self,
        role: type[Role],
        cfg: NodeConfig,
        ecfg: EngineConfig,
        engine: Engine,
        tokenizer: Tokenizer,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the process's engine thread, kept across role switches (the launcher
        builds the engine on it: common/engine/threads.py); None: a thread of its own."""
        # data sockets listen on loopback when the node is reached there by its route to the
        # gateway; a given --advertise-host (a port published by Docker, say) keeps them on
        # every interface
        self.listen = EVERYWHERE
        if not cfg.advertise_host:
            first = cfg.gateway.split(",")[0].strip()
            cfg = dataclasses.replace(cfg, advertise_host=facing_address(first))
            self.listen = listen_host(cfg.advertise_host)
        self.cfg, self.ecfg, self.engine, self.tokenizer = cfg, ecfg, engine, tokenizer
        self.node_id = cfg.node_id or default_node_id(role.role)
        self.key = ClusterKey.load(cfg.cluster_key) if cfg.cluster_key else None
        if self.key is not None and cfg.kv_backend == "ucx":
            log.warning("--kv-backend ucx: KV over UCX is not authenticated by --cluster-key")
        self.ctx = make_context(self.key)
        model_id = getattr(engine, "model_id", "unknown")
        base = SchedulerConfig.of(ecfg, engine.num_blocks, engine.block_size, role.mode,
                                  model_id, True)  # fmt: skip
        self.scheduler = Scheduler(role.scheduler_config(base))
        # each role fits the model's own limit to its cache (the watermark differs by role):
        # a node switched to another role starts from the model's, not the last role's fit
        own = _OWN_LIMIT.setdefault(engine, engine.max_model_len)
        engine.max_model_len = self.scheduler.fit(own)
        self.blocks = self.scheduler.block_manager
        self.requests: dict[str, NodeRequest] = {}
        self.metrics = NodeMetrics(self.node_id, role.role, self.load, engine.num_blocks)
        self.metrics.engine_info(ecfg.dtype, ecfg.quantization, engine.kernels)
        self.tiers = make_tiers(ecfg, self.node_id)
        if self.tiers is not None:
            kv = engine.kv_store
            self.scheduler.attach_tiers(self.tiers, kv.read_block, kv.write_block)
            self.metrics.kv_tiers(lambda: dict(self.tiers.stats) if self.tiers else {})
        self.token_cost = 0.0  # measured seconds per prefilled token (0: none measured yet)
        self.background: set[asyncio.Future] = set()
        self.own_executor = executor is None
        executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"{role.role}-engine")
        self.steps = StepLoop(self.scheduler, executor, self.metrics, self.drop,
                              self.observe_prefill)  # fmt: skip
        self.role = role(self)
        self.steps.hooks = self.role
        caching = self.scheduler.cfg.prefix_caching
        self.events = PrefixEvents(self.node_id, self.blocks, caching)
        self.control = ControlPlane(cfg, self.node_id, self.ctx, self, self.role, self.events,
                                    self.metrics)  # fmt: skip
        # the KV data plane (common/node/kv.py): prefill and decode nodes
        self.kv = NodeKv(self, self.role) if role.has_data_plane else None
        if self.kv is not None:
            self.steps.scheduled = self.kv.fetches.unpin

    # -- what others see of the node --------------------------------------------------------
    def kv_local(self, data_address: str = "") -> Local:
        """What the node's KV connectors know of it."""
        cfg = self.cfg
        return Local(
            node_id=self.node_id,
            host_id=host_identity(),
            advertise_host=cfg.advertise_host,
            listen=self.listen,
            kv=self.engine.kv_store,
            data_address=data_address,
            timeout=cfg.kv_transfer_timeout,
            ports={"tcp": cfg.kv_tcp_port},
            forced=cfg.kv_backend,
            key=self.key,
            max_tokens=self.engine.max_model_len,
        )

    def info(self) -> NodeInfo:
        eng = self.engine
        return NodeInfo(
            node_id=self.node_id,
            role=self.role.role,  # type: ignore[arg-type]
            data_address=self.kv.address if self.kv is not None else "",
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
            kv_endpoints=self.kv.endpoints if self.kv is not None else {},
            features=NODE_FEATURES,
            code_path=getattr(eng, "code_path", ""),  # kernels, CPU level: must match too
            vocab_size=eng.model_config.vocab_size,  # what `engine_limits` takes
        )

    def load(self) -> Load:
        sched, bm = self.scheduler, self.blocks
        # an allocation takes free blocks, then cached ones, short of the watermark: both
        # offered only up to it (gateways add them up as a node's room)
        promised = self.role.promised_blocks()  # accepted, allocated at admission: not free
        offered = max(0, bm.num_free_blocks - sched.cfg.watermark_blocks - promised)
        free = min(bm.num_free_blocks - bm.num_cached_blocks, offered)  # taken first
        extra = self.role.extra_held()
        fetches = self.kv.fetches if self.kv is not None else None
        return Load(
            running=len(sched.running),
            waiting=len(sched.waiting) + len(extra) + (len(fetches.fetching) if fetches else 0),
            # blocks held back by the watermark are not offered: work needing them waits
            blocks_free=free,
            blocks_cached=offered - free,
            blocks_in_use=bm.num_in_use_blocks + promised,
            held=(*self.requests, *extra),
            draining=self.control.draining,
            prefix_queries=sched.prefix_queries,
            prefix_hits=sched.prefix_hits,
            prefix_fetched=fetches.fetched_tokens if fetches else 0,
            token_cost=self.token_cost,
        )

    def foreign(self, request_ids: list[str]) -> Foreign:
        """What these requests (held for other gateways) weigh: prompts still to prefill,
        and the rest (decoding, or KV arriving)."""
        prefill: list[int] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.seq.num_output_tokens == 0:
                prefill.append(req.seq.num_prompt_tokens)
        return Foreign(prefill=tuple(prefill), decoding=len(request_ids) - len(prefill))

    def finished(self, seq: Sequence, reason: str) -> None:
        """A request ended here (its last token computed): let it go; an orphan's tokens
        stay with the adoption until another gateway takes them (common/node/adoption.py)."""
        req = self.requests.pop(seq.seq_id, None)
        self.scheduler.finish(seq, reason)
        if req is not None:
            self.control.adoption.ended(req, reason)

    async def give_back(self, rid: str, req: NodeRequest | None, reason: str) -> None:
        """`rid` leaves this node to be placed again (preempted, handed back): its gateway
        re-places it; an orphan's tokens wait for its adopter, which re-places it (`Adopted`
        with finish_reason "preempted"), instead of its Preempted going nowhere. A live
        gateway's are kept a while too (`recent`): it may be dead, not yet seen silent, or
        its `Release` may cross the Preempted (its client left): then they are orphans."""
        if req is not None:
            orphan = self.control.gateways.owners.orphan(rid)
            self.control.adoption.ended(req, GIVEN_BACK)
            if orphan:
                self.metrics.orphans("given_back", 1)
                if self.control.adoption.given_back(rid):
                    return  # its silent gateway is told if it answers again
        await self.control.push_tokens(Preempted(node_id=self.node_id, request_id=rid,
                                                 reason=reason))  # fmt: skip

    def engine_limits(self) -> tuple[int, int]:
        """What a prompt may be here: shorter than this many tokens, ids below the second."""
        return self.engine.max_model_len, self.engine.model_config.vocab_size

    def let_orphan_go(self, rid: str) -> bool:
        """An orphan's KV refused by its decode node: no gateway would answer its NeedDecode
        (it waited "in prefill" for the grace, then was lost). Its tokens are kept for an
        adopter, which places it again, and its KV freed here. False: not an orphan."""
        req = self.requests.get(rid)
        if req is None or not self.control.gateways.owners.orphan(rid):
            return False
        self.control.adoption.ended(req, GIVEN_BACK)
        self.control.adoption.given_back(rid)  # a silent gateway is told if it answers again
        self.metrics.orphans("given_back", 1)
        self.abort(rid)
        return True

    def orphan(self, rid: str) -> bool:
        """Its gateway is silent or gone: nobody reads what the node says of it."""
        return self.control.gateways.owners.orphan(rid)

    def holds(self, rid: str) -> bool:
        return rid in self.requests

    def unpark(self, rid: str) -> None:
        """A sequence parked to move whose move will never come (its gateway is gone):
        it decodes here again."""
        if self.scheduler.resume(rid):
            self.steps.wake()

    def adopted(self, rid: str) -> None:
        self.role.on_adopted(rid)

    def idle(self) -> bool:
        """Nothing held: a draining node may exit. Ended orphans' tokens count: a client
        may still resume them (within the grace; a drain waits --drain-timeout at most)."""
        held = self.requests or self.role.extra_held()
        return not held and not self.control.adoption.finished

    def hung(self) -> str | None:
        return self.steps.hung(self.cfg.step_timeout, time.monotonic())

    @property
    def registered(self) -> asyncio.Event:
        return self.control.registered

    @property
    def stopped(self) -> asyncio.Event:
        return self.control.stopped

    @property
    def draining(self) -> bool:
        return self.control.draining

    @property
    def intake(self) -> KvIntake:
        assert self.kv is not None
        return self.kv.intake

    @property
    def sender(self) -> KvSender:
        assert self.kv is not None
        return self.kv.sender

    # -- requests ----------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        """The one way a request ends early, whatever the role (see the module's note)."""
        self.steps.abort(rid)

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            log.info("lease expired for %s: freeing its KV", rid)
            self.abort(rid)

    def drop(self, rid: str) -> None:
        """Drop now (`abort` waits for the step that computes it)."""
        req = self.requests.pop(rid, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self.steps.wake()  # blocks freed: waiting work may fit now
        if self.kv is not None:
            self.kv.fetches.cancel(rid)
        self.role.on_dropped(rid, req)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that only prefilled `tokens` took `seconds`: what recomputing costs."""
        if tokens <= 0 or seconds <= 0:
            return
        per = seconds / tokens
        self.token_cost = per if not self.token_cost else 0.8 * self.token_cost + 0.2 * per
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds)

    # -- to the gateway ----------------------------------------------------------------------
    async def send_gateway(self, msg: Msg) -> None:
        """To the gateway the message's request belongs to (KvEvents: to every gateway)."""
        await self.control.send(msg)

    def gateway_of(self, rid: str) -> str:
        return self.control.gateways.gateway_of(rid)

    async def push_step(self, out: list[tuple[Sequence, str | None]]) -> None:
        """One TokenBatch with each sequence's newest token, its output index and finish
        reason (decode and colocated nodes, after a step)."""
        if out:
            await self.control.push_tokens(
                TokenBatch(
                    node_id=self.node_id,
                    request_ids=[s.seq_id for s, _ in out],
                    token_ids=[s.token_ids[-1] for s, _ in out],
                    indices=[s.num_output_tokens - 1 for s, _ in out],
                    finish_reasons=[reason for _, reason in out],
                )
            )

    async def hand_back(self, reason: str) -> None:
        """Give every held request back to the gateway to be re-placed (decode, colocated)."""
        for rid in list(self.requests):
            await self.give_back(rid, self.requests.get(rid), reason)
            self.abort(rid)

    def spawn(self, coro: Any) -> None:
        """Fire and forget, keeping a reference so the task is not collected mid-flight."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- life --------------------------------------------------------------------------------
    async def serve(self) -> None:
        if self.tiers is not None:  # disk reads off this loop: the step loop woken after
            loop = asyncio.get_running_loop()
            self.tiers.read_ahead(lambda: loop.call_soon_threadsafe(self.steps.wake))
        tasks = await self.kv.start() if self.kv is not None else []
        tasks.append(asyncio.create_task(self.steps.run()))
        await self.control.start(tasks)
        try:
            await self.control.wait_stopped()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        await self.control.stop()
        if self.kv is not None:
            await self.kv.close()
        if self.own_executor:
            self.steps.executor.shutdown(wait=True, cancel_futures=True)
        else:  # shared with the next role: wait out what this one queued on it
            await self.steps.run_engine(lambda: None)
        if self.tiers is not None:
            self.tiers.close()
        self.control.close()
        close_context(self.ctx)

    def parts(self) -> list[object]:
        """The objects whose loops the node runs (a stopped node leaves none running)."""
        return [self, self.control, self.steps, self.role, self.kv]


def make_tiers(ecfg: EngineConfig, node_id: str) -> TierStore | None:
    """The prefix cache's host and disk tiers, when sized (common/engine/tiers.py)."""
    if not (ecfg.kv_host_cache_gb or ecfg.kv_disk_cache_gb) or ecfg.prefix_caching != "on":
        return None
    # a given folder holds a subfolder per node: nodes sharing one (`pdserve up` gives every
    # node the same flags) evicted, and at start cleared, each other's blocks. Either root is
    # swept of killed nodes' folders (by their locks: a live node's stays), as a default node
    # id names the process, so a restart never reuses a killed node's folder
    given = ecfg.kv_disk_cache_dir
    root = Path(given) if given else cache_dir() / "kv-tier"
    sweep_dead_tiers(root)
    folder = str(root / (node_id if given else f"{node_id}-{os.getpid()}"))
    return TierStore(int(ecfg.kv_host_cache_gb * 2**30), int(ecfg.kv_disk_cache_gb * 2**30), folder)
