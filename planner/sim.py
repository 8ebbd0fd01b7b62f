"""A discrete-event simulation of a pdserve cluster in virtual time: the planner's model.

Nothing is re-implemented that the cluster already has. Each node is the engine's own
`Scheduler` (common/engine/scheduler.py) in its role's mode, and a step lasts what the cost
model says (common/costmodel.py: the formulas the sim engine sleeps for). Placement is the
gateway's own: waiting requests take turns in the admission order (gateway/admission.py),
each asks `plan()` (gateway/plan.py) with the configured policy over a `ClusterView` and
`RequestTable`, and each prefill node asked answers at once by its scheduler's `can_take`
(on-demand forwarding). Decode blocks are reserved at placement, the KV arrives
`transfer_seconds` after the prefill step ends, and a decode node preempting hands the
request back to be placed again, as the real ones do.

What it leaves out: message latency and the gateway's view lagging the nodes' (it reads
their state at each decision), and the cluster's prefix index (placement is cache-blind;
each node's own prefix cache works, as the scheduler keeps it). The output is one
`RequestRecord` per request (loadgen/metrics.py), every token's time included, so the
summary uses the load generator's definitions of TTFT, TPOT, ITL and goodput.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pdserve.common.config import EngineConfig
from pdserve.common.costmodel import CostModel
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import SeqStatus, Sequence
from pdserve.common.protocol import Load, NodeInfo
from pdserve.common.sampling import SamplingParams
from pdserve.gateway.admission import Waiting, order
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.plan import plan
from pdserve.gateway.policies import Need, make_policy
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.table import RequestTable
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workloads import RequestSpec

FINGERPRINT = "sim"


@dataclass(frozen=True)
class SimConfig:
    prefill: int
    decode: int
    profile: str = "h100-llama3.1-8b"
    prefill_max_batch: int = 32
    decode_max_batch: int = 1 << 30  # a decode node runs every sequence it holds
    max_batch_tokens: int = 8192
    chunk_size: int = 0
    num_kv_blocks: int = 0  # 0: what the profile's memory holds
    prefix_caching: bool = True
    policy: str = "on_demand"
    decode_placement: str = "spread"
    admission: str = "spf"
    admission_max_wait: float = 3.0
    admission_aging: float = 0.5
    step_overhead_s: float = 0.0  # added to every step (the real nodes' loop, if measured)


@dataclass(eq=False)
class _Node:
    info: NodeInfo
    sched: Scheduler
    busy: bool = False
    out: SchedulerOutput | None = None


@dataclass(eq=False)
class _Request:
    spec: RequestSpec
    index: int
    req: GatewayRequest
    record: RequestRecord
    entry: Waiting
    prefill: str = ""  # node ids of its current attempt
    decode: str = ""
    reserved: list[int] = field(default_factory=list)  # decode blocks held for its KV
    seq: Sequence | None = None


class ClusterSim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.cost = CostModel.named(cfg.profile)
        self.policy = make_policy(cfg.policy, cfg.profile, cfg.decode_placement)
        self.cluster = ClusterView(math.inf)
        self.table = RequestTable()
        self.nodes: dict[str, _Node] = {}
        self.now = 0.0
        self.events: list[tuple[float, int, str, str]] = []
        self._ticket = itertools.count()
        self.waiting: dict[str, _Request] = {}  # by request id, arrival order
        self.requests: dict[str, _Request] = {}  # by wire id, placed
        self.replacements = 0
        for i in range(cfg.prefill):
            self._add_node("prefill", f"prefill-{i}")
        for i in range(cfg.decode):
            self._add_node("decode", f"decode-{i}")

    # -- set-up ------------------------------------------------------------------------------
    def _add_node(self, role: Literal["prefill", "decode"], node_id: str) -> None:
        cfg = self.cfg
        ecfg = EngineConfig(
            engine="sim",
            sim_profile=cfg.profile,
            max_batch=cfg.prefill_max_batch if role == "prefill" else cfg.decode_max_batch,
            max_batch_tokens=cfg.max_batch_tokens if role == "prefill" else 1 << 30,
            chunk_size=cfg.chunk_size if role == "prefill" else 0,
            prefix_caching="on" if cfg.prefix_caching else "off",
        )
        block = ecfg.block_size
        blocks = cfg.num_kv_blocks or max(1, self.cost.kv_capacity_tokens() // block)
        model_id = f"sim-{cfg.profile}"
        sched = Scheduler(SchedulerConfig.of(ecfg, blocks, block, role, model_id))
        info = NodeInfo(
            node_id=node_id,
            role=role,
            data_address="",
            host_id="sim",
            model_id=model_id,
            dtype="sim",
            tokenizer_fingerprint=FINGERPRINT,
            kv_layout="sim",
            block_size=block,
            num_blocks=blocks,
            max_batch=ecfg.max_batch,
            max_batch_tokens=ecfg.max_batch_tokens,
            max_model_len=self.cost.model.max_context,
        )
        refused = self.cluster.register(info, node_id.encode(), 0.0, FINGERPRINT)
        assert refused is None, refused
        self.nodes[node_id] = _Node(info, sched)
        self._report(node_id)

    def _report(self, node_id: str) -> None:
        """The node's load as its heartbeat would say it, now (no reporting lag)."""
        node = self.nodes[node_id]
        sched, bm = node.sched, node.sched.block_manager
        load = Load(
            running=len(sched.running),
            waiting=len(sched.waiting),
            # cached blocks count as free: they are taken when needed (a heartbeat splits
            # them out, and the gateway adds them back)
            blocks_free=max(0, bm.num_free_blocks - sched.cfg.watermark_blocks),
            blocks_cached=0,
            blocks_in_use=bm.num_in_use_blocks,
        )
        self.cluster.heartbeat(node_id, node_id.encode(), load, self.now)

    # -- the run -----------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        """Every request to its end; their records (sent = arrival offset)."""
        records = []
        for i, spec in enumerate(specs):
            self._push(spec.arrival, "arrive", str(i))
        by_index: dict[int, _Request] = {}
        while self.events:
            self.now, _, kind, key = heapq.heappop(self.events)
            if kind == "arrive":
                r = self._arrive(specs[int(key)], int(key))
                by_index[r.index] = r
            elif kind == "step":
                self._step_done(self.nodes[key])
            elif kind == "kv":
                self._kv_arrived(key)
            self._place()
            for node in self.nodes.values():
                if not node.busy:
                    self._start_step(node)
        for i in range(len(specs)):
            records.append(by_index[i].record)
        return records

    def _push(self, at: float, kind: str, key: str) -> None:
        heapq.heappush(self.events, (at, next(self._ticket), kind, key))

    def _arrive(self, spec: RequestSpec, index: int) -> _Request:
        prompt = spec.prompt if isinstance(spec.prompt, list) else [1000] * spec.prompt_len
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        req = GatewayRequest(
            request_id=f"r{index}",
            kind="completion",
            model="sim",
            prompt_ids=prompt,
            params=params,
            stream=True,
            include_usage=False,
            tokenizer=cast(Any, None),  # no text is made here: token ids only
        )
        entry = Waiting(
            key=index, arrived=self.now, prefill_s=self.cost.prefill_seconds(len(prompt))
        )
        r = _Request(spec, index, req, RequestRecord(index, sent=self.now), entry)
        r.record.prompt_tokens = len(prompt)
        self.table.open(req, len(prompt))
        self.waiting[req.request_id] = r
        return r

    # -- placement (the gateway's round) ------------------------------------------------------
    def _place(self) -> None:
        if not self.waiting:
            return
        cfg = self.cfg
        ordered = order(
            cfg.admission,
            [r.entry for r in self.waiting.values()],
            self.now,
            cfg.admission_max_wait,
            cfg.admission_aging,
        )
        by_key = {r.entry.key: r for r in self.waiting.values()}
        full: set[str] = set()  # prefill nodes that said no this round
        for entry in ordered:
            if len(full) >= self.cfg.prefill:
                break
            r = by_key[entry.key]
            prompt = r.req.prompt_ids + r.req.output_ids  # a re-placement recomputes both
            need = Need(len(prompt), output_len=r.spec.max_tokens - len(r.req.output_ids))
            for p, d in plan(self.policy, self.cluster, self.table, need):
                if p.node_id in full:
                    continue
                pnode, dnode = self.nodes[p.node_id], self.nodes[d.node_id]
                if pnode.sched.can_take(len(prompt), self.policy.queueing) is not None:
                    full.add(p.node_id)
                    continue
                bm = dnode.sched.block_manager
                blocks = bm.blocks_needed(len(prompt) + 1)
                if not bm.can_allocate(blocks, reserve=dnode.sched.cfg.watermark_blocks):
                    continue
                self._commit(r, prompt, pnode, dnode, bm.allocate(blocks))
                break

    def _commit(
        self, r: _Request, prompt: list[int], pnode: _Node, dnode: _Node, blocks: list[int]
    ) -> None:
        del self.waiting[r.req.request_id]
        attempt = self.table.current(r.req)
        assert attempt is not None
        self.table.commit(attempt, pnode.info.node_id, dnode.info.node_id, len(blocks), self.now)
        r.prefill, r.decode, r.reserved = pnode.info.node_id, dnode.info.node_id, blocks
        r.seq = Sequence.new(attempt.wire_id, prompt, r.req.params)
        self.requests[attempt.wire_id] = r
        pnode.sched.add(r.seq)
        self._report(pnode.info.node_id)
        self._report(dnode.info.node_id)

    # -- engines -----------------------------------------------------------------------------
    def _start_step(self, node: _Node) -> None:
        out = node.sched.schedule()
        if out.empty:
            return
        seconds = self.cost.step_seconds(
            [(n, seq.num_computed_tokens) for seq, n in out.prefills],
            [seq.num_tokens for seq in out.decodes],
        )
        node.busy, node.out = True, out
        self._push(self.now + seconds + self.cfg.step_overhead_s, "step", node.info.node_id)

    def _step_done(self, node: _Node) -> None:
        out, node.busy, node.out = node.out, False, None
        assert out is not None
        finishing = sum(s.num_computed_tokens + n == s.num_tokens for s, n in out.prefills)
        grew = node.sched.on_step_done(out, [1000] * (finishing + len(out.decodes)))
        node_id = node.info.node_id
        for seq in grew:
            r = self.requests[seq.seq_id]
            r.record.chunk_times.append(self.now)
            r.req.output_ids.append(1000)
            if node.info.role == "prefill":
                kv = self.cost.transfer_seconds(seq.num_tokens - 1)  # the prompt's KV
                self._push(self.now + kv, "kv", seq.seq_id)
            elif len(r.req.output_ids) >= r.spec.max_tokens:
                node.sched.finish(seq, "length")
                self._finish(r)
        for seq in out.preempted:  # decode mode: handed back, its blocks freed
            self._replace(self.requests.pop(seq.seq_id))
        self._report(node_id)

    def _kv_arrived(self, wire_id: str) -> None:
        r = self.requests.get(wire_id)
        if r is None or r.seq is None:
            return
        self.nodes[r.prefill].sched.release(wire_id)
        attempt = self.table.get(wire_id)
        assert attempt is not None
        self.table.prefilled(attempt)
        if len(r.req.output_ids) >= r.spec.max_tokens:  # a one-token request ends here
            self.nodes[r.decode].sched.block_manager.free(r.reserved)
            self._finish(r)
        else:
            seq = Sequence(
                seq_id=wire_id,
                token_ids=list(r.seq.token_ids),
                num_prompt_tokens=r.seq.num_prompt_tokens,
                params=r.req.params,
                block_table=r.reserved,
                num_computed_tokens=r.seq.num_tokens - 1,
                status=SeqStatus.RUNNING,
            )
            r.seq = seq
            self.nodes[r.decode].sched.admit_prefilled(seq)
            self.table.delivered(attempt, self.now)
        self._report(r.prefill)
        self._report(r.decode)

    def _finish(self, r: _Request) -> None:
        self.requests.pop(r.seq.seq_id if r.seq else "", None)
        self.table.close(r.req.wire_id)
        r.record.done = self.now
        r.record.output_tokens = len(r.req.output_ids)

    def _replace(self, r: _Request) -> None:
        """A decode node preempted it: placed again, prompt + output recomputed."""
        self.replacements += 1
        self.table.close(r.req.wire_id)
        r.req.attempt += 1
        r.req.base = len(r.req.output_ids)
        self.table.open(r.req, len(r.req.prompt_ids) + len(r.req.output_ids))
        r.entry = Waiting(
            key=r.entry.key, arrived=r.entry.arrived, prefill_s=r.entry.prefill_s, resumed=True
        )
        self.waiting[r.req.request_id] = r
