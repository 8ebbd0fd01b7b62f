"""A discrete-event simulation of a pdserve cluster in virtual time: the planner's model.

Nothing is re-implemented that the cluster already has. Each node is the engine's own
`Scheduler` (common/engine/scheduler.py) in its role's mode, and a step lasts what the cost
model says (common/costmodel.py: the formulas the sim engine sleeps for). Placement is the
gateway's own round (planner/rounds.py): waiting requests take turns in the admission order
(gateway/admission.py), each asks the gateway's policy over the nodes' views, and each
prefill node asked answers at once by its scheduler's `can_take` (on-demand forwarding). As
the gateway's, a round runs when capacity may have freed or a request arrived, not after a
decode step that only grew its sequences. Decode blocks are reserved at placement, the KV
arrives `transfer_seconds` after the prefill step ends, and a decode node preempting hands
the request back to be placed again, as the real ones do.

Cost: one event per request phase, not per token. A decode node steps in runs between the
events that change its batch (planner/decode_run.py), with the same tokens and times as
stepping it (`decode_runs=False`, kept for the tests that say so).

What it leaves out: message latency and the gateway's view lagging the nodes' (it reads
their state at each decision), and the cluster's prefix index (placement is cache-blind;
each node's own prefix cache works, as the scheduler keeps it). The output is one
`RequestRecord` per request (loadgen/metrics.py), every token's time included, so the
summary uses the load generator's definitions of TTFT, TPOT, ITL and goodput.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any, Literal, cast

from pdserve.common.costmodel import CostModel
from pdserve.common.engine.sequence import SeqStatus, Sequence
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Load
from pdserve.gateway.admission import Waiting
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.policies import make_policy
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.table import RequestTable
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.decode_run import TOKEN, DecodeRun, plan_run, prompt_tokens
from pdserve.planner.rounds import Rounds
from pdserve.planner.simnodes import FINGERPRINT, SimConfig, SimNode, SimRequest, make_node

__all__ = ["ClusterSim", "SimConfig"]

PROGRESS_EVERY = 1024  # events between progress reports (and give-up checks), at most
PROGRESS_MIN = 64


class _EveryId:
    """Holds every id (a simulated node's report shows every attempt headed to it)."""

    def __contains__(self, item: object) -> bool:
        return True


EVERY_ID = _EveryId()


class ClusterSim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.cost = CostModel.named(cfg.profile)
        self.policy = make_policy(cfg.policy, cfg.profile, cfg.decode_placement)
        self.cluster = ClusterView(math.inf)
        self.table = RequestTable()
        self.nodes: dict[str, SimNode] = {}
        self.now = 0.0
        self.events: list[tuple[float, int, str, str, int]] = []
        self._ticket = itertools.count()
        self.waiting: dict[str, SimRequest] = {}  # by request id, arrival order
        self.requests: dict[str, SimRequest] = {}  # by wire id, placed
        self.replacements = 0
        self.finished = 0
        self.events_done = 0  # events processed (a decode run is one)
        self.arrived: dict[int, SimRequest] = {}  # by index in the workload
        self.total = 0
        self.rounds = Rounds(self, self._commit)
        self._changed = False  # capacity may have freed, or a request arrived: a round is due
        self._kick: set[str] = set()  # nodes that may start a step
        for i in range(cfg.prefill):
            self._add_node("prefill", f"prefill-{i}")
        for i in range(cfg.decode):
            self._add_node("decode", f"decode-{i}")

    @property
    def peak_prefill_batch(self) -> int:
        """The most sequences any prefill node's batch held: a batch limit above it never
        bound (every offer refused was refused for tokens or KV, not for the count)."""
        return max((n.peak_batch for n in self.nodes.values()), default=0)

    # -- set-up ------------------------------------------------------------------------------
    def _add_node(self, role: Literal["prefill", "decode"], node_id: str) -> None:
        node = make_node(self.cfg, self.cost, role, node_id, len(self.nodes))
        refused = self.cluster.register(node.info, node_id.encode(), 0.0, FINGERPRINT)
        assert refused is None, refused
        self.nodes[node_id] = node
        self._report(node_id)

    def _report(self, node_id: str, at: float | None = None) -> None:
        """The node's load as its heartbeat would say it (no reporting lag)."""
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
        self.cluster.heartbeat(node_id, node_id.encode(), load, self.now if at is None else at)
        # its blocks are taken when the gateway commits (no header to wait for): it holds
        # every attempt headed to it (listing them costs 5-10 % of a plan)
        self.cluster.nodes[node_id].held = EVERY_ID
        self.rounds.forget(node_id)

    # -- the run -----------------------------------------------------------------------------
    def run(
        self, specs: list[RequestSpec], watch: Callable[[ClusterSim], None] | None = None
    ) -> list[RequestRecord]:
        """Every request to its end; their records (sent = arrival offset). `watch` is
        called now and then (it may end the run by raising)."""
        for i, spec in enumerate(specs):
            self._push(spec.arrival, "arrive", str(i))
        self.total = len(specs)
        every = max(PROGRESS_MIN, min(PROGRESS_EVERY, len(specs) // 8))
        by_index = self.arrived
        while self.events:
            self.events_done += 1
            if watch is not None and self.events_done % every == 0:
                watch(self)
            self.now, _, kind, key, gen = heapq.heappop(self.events)
            if kind == "arrive":
                r = self._arrive(specs[int(key)], int(key))
                by_index[r.index] = r
            elif kind == "kv":
                self._kv_arrived(key)
            elif self.nodes[key].gen != gen:
                continue  # a run cut short: its end moved
            elif kind == "step":
                self._step_done(self.nodes[key])
            else:
                self._run_done(self.nodes[key])
            if self._changed:
                self._changed = False
                self._sync_decodes()
                self.rounds.run()
            for node_id in sorted(self._kick, key=lambda n: self.nodes[n].index):
                self._start_step(self.nodes[node_id])
            self._kick.clear()
        for r in by_index.values():
            if not (r.record.done or r.record.error):  # stuck (outgrew a decode cache): failed
                r.record.error = "never finished in the simulation"
        return [by_index[i].record for i in range(len(specs))]

    def _push(self, at: float, kind: str, key: str, gen: int = 0) -> None:
        heapq.heappush(self.events, (at, next(self._ticket), kind, key, gen))

    def _arrive(self, spec: RequestSpec, index: int) -> SimRequest:
        prompt = prompt_tokens(spec.prompt, spec.prompt_len)
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
            key=index,
            arrived=self.now,
            prefill_s=self.cost.prefill_seconds(len(prompt)),
            deadline=self.now + self.cfg.ttft_slo,  # as the gateway's placer sets it
        )
        r = SimRequest(spec, index, req, RequestRecord(index, sent=self.now), entry)
        r.record.prompt_tokens = len(prompt)
        if len(prompt) + spec.max_tokens > self.cluster.max_model_len:
            # refused, as the gateway answers it (400): never placed
            r.record.error = "prompt + max_tokens exceed the model's context"
            r.record.done = self.now
            self.finished += 1
            return r
        self.table.open(req, len(prompt))
        self.waiting[req.request_id] = r
        self.rounds.add(r)
        self._changed = True
        return r

    def _commit(self, r: SimRequest, prompt: list[int], pnode: SimNode, dnode: SimNode) -> None:
        if dnode.run is not None:  # fewer free blocks: its run may end sooner
            self._cut(dnode)
        bm = dnode.sched.block_manager
        blocks = bm.allocate(bm.blocks_needed(len(prompt) + 1))
        del self.waiting[r.req.request_id]
        self.rounds.remove(r)
        attempt = self.table.current(r.req)
        assert attempt is not None
        self.table.commit(attempt, pnode.info.node_id, dnode.info.node_id, len(blocks), self.now)
        r.prefill, r.decode, r.reserved = pnode.info.node_id, dnode.info.node_id, blocks
        r.seq = Sequence.new(attempt.wire_id, prompt, r.req.params)
        self.requests[attempt.wire_id] = r
        pnode.sched.add(r.seq)
        sched = pnode.sched
        pnode.peak_batch = max(pnode.peak_batch, len(sched.running) + len(sched.waiting))
        self._kick.add(pnode.info.node_id)
        self._report(pnode.info.node_id)
        self._report(dnode.info.node_id)

    # -- engines -----------------------------------------------------------------------------
    def _start_step(self, node: SimNode) -> None:
        if node.busy:
            return
        self.rounds.forget(node.info.node_id)  # its batch changes: so does its room
        if node.info.role == "decode" and self.cfg.decode_runs:
            remaining = [
                self.requests[s.seq_id].spec.max_tokens
                - len(self.requests[s.seq_id].req.output_ids)
                for s in node.sched.running
            ]
            run = plan_run(node.sched, remaining, self.now, self.cost, self.cfg.step_overhead_s)
            if run is not None:
                run.begin()  # its first step takes its blocks now
                node.busy, node.run, node.gen = True, run, node.gen + 1
                self._push(run.end, "run", node.info.node_id, node.gen)
                return
        out = node.sched.schedule()
        if out.empty:
            return
        seconds = self.cost.step_seconds(
            [(n, seq.num_computed_tokens) for seq, n in out.prefills],
            [seq.num_tokens for seq in out.decodes],
        )
        node.busy, node.out, node.gen = True, out, node.gen + 1
        end = self.now + seconds + self.cfg.step_overhead_s
        self._push(end, "step", node.info.node_id, node.gen)

    def _sync_decodes(self) -> None:
        """Bring every decode node in a run to now (its blocks and load, as a round reads)."""
        for node in self.nodes.values():
            if node.run is not None:
                self._advance(node, node.run)

    def _advance(self, node: SimNode, run: DecodeRun) -> None:
        if run.to(self.now):  # reported as at its last step's end, before the next began
            self._report(node.info.node_id, run.ends[run.done - 1])
        run.begin()

    def _cut(self, node: SimNode) -> None:
        run = node.run
        assert run is not None
        self._advance(node, run)
        end = run.end
        run.cut()
        if run.end != end:
            node.gen += 1
            self._push(run.end, "run", node.info.node_id, node.gen)

    def _run_done(self, node: SimNode) -> None:
        run = node.run
        assert run is not None
        run.to(self.now)
        seqs, times = run.flush()
        node.busy, node.run = False, None
        for seq in seqs:
            r = self.requests[seq.seq_id]
            r.record.chunk_times.extend(times)
            r.req.output_ids.extend([TOKEN] * len(times))
            if len(r.req.output_ids) >= r.spec.max_tokens:
                node.sched.finish(seq, "length")
                self._finish(r)
        self._report(node.info.node_id)
        self._kick.add(node.info.node_id)

    def _step_done(self, node: SimNode) -> None:
        out, node.busy, node.out = node.out, False, None
        assert out is not None
        finishing = sum(s.num_computed_tokens + n == s.num_tokens for s, n in out.prefills)
        grew = node.sched.on_step_done(out, [TOKEN] * (finishing + len(out.decodes)))
        node_id = node.info.node_id
        for seq in grew:
            r = self.requests[seq.seq_id]
            r.record.chunk_times.append(self.now)
            r.req.output_ids.append(TOKEN)
            if node.info.role == "prefill":
                if len(r.req.output_ids) >= r.spec.max_tokens:
                    self._kv_arrived(seq.seq_id)  # it ends at its first token: no KV sent
                    continue
                kv = self.cost.transfer_seconds(seq.num_tokens - 1)  # the prompt's KV
                self._push(self.now + kv, "kv", seq.seq_id)
            elif len(r.req.output_ids) >= r.spec.max_tokens:
                node.sched.finish(seq, "length")
                self._finish(r)
        for seq in out.preempted:  # decode mode: handed back, its blocks freed
            self._replace(self.requests.pop(seq.seq_id))
        if node.info.role == "prefill":
            self._changed = True  # its batch has room again
        self._report(node_id)
        self._kick.add(node_id)

    def _kv_arrived(self, wire_id: str) -> None:
        r = self.requests.get(wire_id)
        if r is None or r.seq is None:
            return
        dnode = self.nodes[r.decode]
        if dnode.run is not None:  # its batch grows after the step in flight
            self._cut(dnode)
        self.nodes[r.prefill].sched.release(wire_id)
        attempt = self.table.get(wire_id)
        assert attempt is not None
        self.table.prefilled(attempt)
        if len(r.req.output_ids) >= r.spec.max_tokens:  # a one-token request ends here
            dnode.sched.block_manager.free(r.reserved)
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
            dnode.sched.admit_prefilled(seq)
            self.table.delivered(attempt, self.now)
        self._changed = True  # the prefill node's blocks are free
        self._kick.update((r.prefill, r.decode))
        self._report(r.prefill)
        self._report(r.decode)

    def _finish(self, r: SimRequest) -> None:
        self.requests.pop(r.seq.seq_id if r.seq else "", None)
        self.table.close(r.req.wire_id)
        r.record.done = self.now
        r.record.output_tokens = len(r.req.output_ids)
        self.finished += 1
        self._changed = True  # its decode blocks are free

    def _replace(self, r: SimRequest) -> None:
        """A decode node preempted it: placed again, prompt + output recomputed."""
        self.replacements += 1
        self.table.close(r.req.wire_id)
        r.req.attempt += 1
        r.req.base = len(r.req.output_ids)
        self.table.open(r.req, len(r.req.prompt_ids) + len(r.req.output_ids))
        r.entry = dataclasses.replace(r.entry, resumed=True)
        r.kept = None  # a new placement, as the gateway's
        self.waiting[r.req.request_id] = r
        self.rounds.add(r)
        self._changed = True
