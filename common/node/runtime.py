"""The node runtime every role runs on: one request table, one step loop, one way to abort.

`requests` holds every request the node has (by wire id) from the moment it takes it until
it lets go: a prefill node from its Accept until the decode node acknowledged the KV, a
decode node from the KV's arrival (its intake holds it before that) until the last token, a
colocated node from Accept to last token. Each entry is the engine `Sequence` (tokens, KV
blocks, scheduling state, in `scheduler`) plus what the role needs beside it.

The step loop asks the scheduler for the next step, lets the role prepare (`before_step`),
runs the engine in one dedicated thread (so the event loop keeps answering offers and
heartbeats during a forward pass; `engine_step` may add a layer hook), and hands the result
to the role (`after_step`). Preempted sequences go to `on_preempted`.

Aborts (client gone, lease expired, stop string) go through `abort` alone: a request the
running step is computing is dropped right after the step (its blocks are in use until
then, and its token from that step is not sent); any other at once. Dropping frees its blocks
wherever the scheduler holds it (waiting, running, parked) and lets the role let go of
the rest (`on_dropped`: a KV transfer, an intake).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.common.cache import cache_dir
from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import Mode, Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.tiers import TierStore
from pdserve.common.kv_transfer.base import Intake, Local, Transfer
from pdserve.common.kv_transfer.intake import KvIntake
from pdserve.common.kv_transfer.sender import KvSender
from pdserve.common.node.control import NodeControl
from pdserve.common.node.host import host_identity
from pdserve.common.node.kv import NodeKv
from pdserve.common.protocol import (
    DecodeTarget,
    KvEvents,
    KvHeader,
    Load,
    NodeInfo,
    Preempted,
    RegisterAck,
    TokenBatch,
)
from pdserve.common.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_HASHES = 4096  # per KvEvents message


@dataclass
class NodeRequest:
    seq: Sequence
    accepted_at: float = field(default_factory=time.monotonic)
    target: DecodeTarget | None = None  # prefill: the decode node its KV goes to
    skip: int = 0  # prefill: leading tokens whose KV that node holds (not sent)


class NodeBase(NodeControl):
    mode: Mode = "colocated"
    has_data_plane = False  # KV arrives or leaves over the KV connectors

    def __init__(
        self,
        cfg: NodeConfig,
        ecfg: EngineConfig,
        engine: Engine,
        tokenizer: Tokenizer,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the process's engine thread, kept across role switches (the launcher
        builds the engine on it: common/engine/threads.py); None: a thread of its own."""
        super().__init__(cfg, ecfg, engine, tokenizer)
        self.scheduler = Scheduler(self.scheduler_config())
        self.blocks = self.scheduler.block_manager
        self.requests: dict[str, NodeRequest] = {}
        self.in_step: set[str] = set()  # ids the engine is computing right now
        self.step_over: asyncio.Future[None] | None = None  # resolved when that step ends
        self.aborted: set[str] = set()  # ids to drop once the running step is over
        self.work = asyncio.Event()
        self.own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-engine")
        self.tiers = make_tiers(ecfg, self.node_id)
        if self.tiers is not None:
            self.scheduler.attach_tiers(self.tiers, engine.read_block, engine.write_block)
        self.events_seq = 0  # KvEvents sent since start
        self.snapshot_due = True  # the gateway knows nothing of our prefix cache yet
        self.token_cost = 0.0  # measured seconds per prefilled token (0: none measured yet)
        # the KV data plane (common/node/kv.py): prefill and decode nodes
        self.kv = NodeKv(self) if self.has_data_plane else None

    def scheduler_config(self) -> SchedulerConfig:
        engine = self.engine
        model_id = getattr(engine, "model_id", "unknown")
        return SchedulerConfig.of(
            self.ecfg, engine.num_blocks, engine.block_size, self.mode, model_id, True
        )

    def kv_local(self, data_address: str = "") -> Local:
        """What the node's KV connectors know of it."""
        cfg = self.cfg
        return Local(
            node_id=self.node_id,
            host_id=host_identity(),
            advertise_host=cfg.advertise_host,
            engine=self.engine,
            data_address=data_address,
            timeout=cfg.kv_transfer_timeout,
            ports={"tcp": cfg.kv_tcp_port},
            forced=cfg.kv_backend,
            key=self.key,
        )

    # -- the prefix cache, as the gateway's index sees it ------------------------------------
    def on_registered(self, ack: RegisterAck) -> None:
        self.snapshot_due = True  # a new gateway, or one that dropped us

    def on_kv_resync(self) -> None:
        self.snapshot_due = True

    def kv_seq(self) -> int:
        return self.events_seq - 1

    async def publish(self) -> None:
        """Stored and evicted prefix blocks since the last call, as KvEvents of at most
        `MAX_HASHES` hashes; the whole cache when the gateway needs a snapshot."""
        if not self.scheduler.cfg.prefix_caching:
            return
        events, lost = self.blocks.take_events()
        if lost or self.snapshot_due:
            self.snapshot_due = False
            hashes = self.blocks.cached_hashes()
            await self._send_events(hashes[:MAX_HASHES], [], snapshot=True)
            for i in range(MAX_HASHES, len(hashes), MAX_HASHES):
                await self._send_events(hashes[i : i + MAX_HASHES], [])
            return
        final = {h: stored for stored, h in events}  # a hash's last event in the batch counts
        stored = [h for h, s in final.items() if s]
        evicted = [h for h, s in final.items() if not s]
        for i in range(0, max(len(stored), len(evicted)), MAX_HASHES):
            await self._send_events(stored[i : i + MAX_HASHES], evicted[i : i + MAX_HASHES])

    async def _send_events(
        self, stored: list[bytes], evicted: list[bytes], snapshot: bool = False
    ) -> None:
        msg = KvEvents(
            node_id=self.node_id,
            seq=self.events_seq,
            stored=stored,
            evicted=evicted,
            snapshot=snapshot,
        )
        self.events_seq += 1
        await self.send_gateway(msg)

    # -- hooks of the role -----------------------------------------------------------------
    async def before_step(self, out: SchedulerOutput) -> None:
        """The step is scheduled and about to run."""

    def engine_step(self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop) -> Any:
        """Engine thread: run the step; returns the sampled tokens (or what after_step needs)."""
        from pdserve.common.engine.scheduler import step_work

        return self.engine.step(*step_work(out))

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        """The step is done; `grew` are the sequences that produced a token (aborted ones
        left out)."""

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        """Sequences the scheduler preempted (decode: handed back to the gateway)."""

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        """A request was aborted: let go of what the role holds for it beside the engine."""

    def extra_held(self) -> list[str]:
        """Ids the role holds outside `requests` (a decode node's incoming transfers)."""
        return []

    def reserve_kv(self, h: KvHeader) -> list[int] | str:
        """A request's KV is announced (decode): the blocks it lands in, or why not."""
        return f"a {self.role} node takes no request KV"

    async def admit_kv(self, intake: Intake, first_token: int) -> None:
        """A request's KV has landed (decode)."""

    def kv_acked(self, t: Transfer) -> None:
        """A request's KV we sent was acknowledged (prefill)."""

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        """A request's KV we sent was refused (prefill)."""

    # -- the data plane ----------------------------------------------------------------------
    @property
    def intake(self) -> KvIntake:
        assert self.kv is not None
        return self.kv.intake

    @property
    def sender(self) -> KvSender:
        assert self.kv is not None
        return self.kv.sender

    def data_address(self) -> str:
        return self.kv.address if self.kv is not None else ""

    def info(self) -> NodeInfo:
        endpoints = self.kv.endpoints if self.kv is not None else {}
        return msgspec.structs.replace(super().info(), kv_endpoints=endpoints)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that only prefilled `tokens` took `seconds`: what recomputing costs."""
        if tokens <= 0 or seconds <= 0:
            return
        per = seconds / tokens
        self.token_cost = per if not self.token_cost else 0.8 * self.token_cost + 0.2 * per
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds)

    async def step_failed(self, out: SchedulerOutput, exc: Exception) -> None:
        """The engine raised: by default the node stops (a supervisor restarts it)."""
        raise exc

    # -- the table -------------------------------------------------------------------------
    def load(self) -> Load:
        sched, bm = self.scheduler, self.blocks
        cached = bm.num_cached_blocks
        extra = self.extra_held()
        fetching = len(self.kv.fetches.fetching) if self.kv is not None else 0
        return Load(
            running=len(sched.running),
            waiting=len(sched.waiting) + len(extra) + fetching,
            # blocks held back by the watermark are not offered: work needing them waits
            blocks_free=max(0, bm.num_free_blocks - cached - sched.cfg.watermark_blocks),
            blocks_cached=cached,
            blocks_in_use=bm.num_in_use_blocks,
            held=(*self.requests, *extra),
            draining=self.draining,
            prefix_queries=sched.prefix_queries,
            prefix_hits=sched.prefix_hits,
            prefix_fetched=self.kv.fetches.fetched_tokens if self.kv is not None else 0,
            token_cost=self.token_cost,
        )

    def idle(self) -> bool:
        return not self.requests and not self.extra_held()

    def abort(self, rid: str) -> None:
        """The one way a request ends early, whatever the role (see the module's note)."""
        if rid in self.in_step:
            self.aborted.add(rid)
        else:
            self._drop(rid)

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            log.info("lease expired for %s: freeing its KV", rid)
            self.abort(rid)

    def _drop(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self.work.set()  # blocks freed: waiting work may fit now
        if self.kv is not None:
            self.kv.fetches.cancel(rid)
        self.on_dropped(rid, req)

    async def out_of_step(self, rid: str) -> None:
        """Wait until the engine is not computing `rid` (its blocks are ours again)."""
        while rid in self.in_step and self.step_over is not None:
            await asyncio.shield(self.step_over)  # shielded: a cancelled waiter leaves it be

    async def push_step(self, out: list[tuple[Sequence, str | None]]) -> None:
        """One TokenBatch with each sequence's newest token, its output index and finish
        reason (decode and colocated nodes, after a step)."""
        if out:
            await self.push_tokens(
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
            await self.push_tokens(Preempted(node_id=self.node_id, request_id=rid, reason=reason))
            self.abort(rid)

    # -- the step loop ---------------------------------------------------------------------
    async def run_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def serve(self) -> None:
        if self.kv is not None:
            self.tasks += await self.kv.start()
        self.tasks.append(asyncio.create_task(self._step_loop()))
        await super().serve()

    async def close_role(self) -> None:
        if self.kv is not None:
            await self.kv.close()
        if self.own_executor:
            self.executor.shutdown(wait=True, cancel_futures=True)
        else:  # shared with the next role: wait out what this one queued on it
            await self.run_engine(lambda: None)
        if self.tiers is not None:
            self.tiers.close()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.work.wait()
            self.work.clear()
            while self.scheduler.has_work:
                out = self.scheduler.schedule()
                if out.preempted:
                    await self.on_preempted(out.preempted)
                if out.empty:
                    break  # nothing fits now (KV full): wait for blocks to free
                if self.kv is not None:
                    for seq, _ in out.prefills:  # admission took its fetched blocks itself
                        self.kv.fetches.unpin(seq.seq_id)
                await self.before_step(out)
                self.in_step, self.step_over = out.seq_ids, loop.create_future()
                started = time.monotonic()
                try:
                    result = await self.run_engine(self.engine_step, out, loop)
                except Exception as exc:
                    await self.step_failed(out, exc)
                    continue
                finally:
                    self.in_step = set()
                    self.step_over.set_result(None)
                seconds = time.monotonic() - started
                self.metrics.step_time.observe(seconds)
                if out.prefills and not out.decodes:
                    self.observe_prefill(sum(n for _, n in out.prefills), seconds)
                tokens = result[0] if isinstance(result, tuple) else result
                grew = self.scheduler.on_step_done(out, tokens)
                aborted, self.aborted = self.aborted, set()
                await self.after_step(out, [s for s in grew if s.seq_id not in aborted], result)
                for rid in aborted:
                    self._drop(rid)


def make_tiers(ecfg: EngineConfig, node_id: str) -> TierStore | None:
    """The prefix cache's host and disk tiers, when sized (common/engine/tiers.py)."""
    if not (ecfg.kv_host_cache_gb or ecfg.kv_disk_cache_gb) or ecfg.prefix_caching != "on":
        return None
    folder = ecfg.kv_disk_cache_dir or str(cache_dir() / "kv-tier" / f"{node_id}-{os.getpid()}")
    return TierStore(int(ecfg.kv_host_cache_gb * 2**30), int(ecfg.kv_disk_cache_gb * 2**30), folder)
