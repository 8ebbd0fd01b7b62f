"""One simulated split: its configuration, the load generator's summary of its records,
and what the search needs to rank it and to decide its retries."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.loadgen.metrics import meets, summarize
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.sim import ClusterSim, SimConfig


@dataclass
class Candidate:
    cfg: SimConfig
    summary: dict[str, Any]
    attainment: float  # share of requests meeting every SLO
    replacements: int  # preemptions re-placed (recomputed)
    seconds: float  # simulation wall time
    peak_batch: int = 0  # the most sequences a prefill node's batch held
    bound: float = float("inf")  # the cost model's upper bound on its goodput per node
    # requests meeting every SLO per second, unrounded: the summary's is rounded to 4
    # decimals, 0 at low rates, where every split tied (None: the summary's)
    exact_goodput: float | None = None

    @property
    def nodes(self) -> int:
        return self.cfg.prefill + self.cfg.decode

    @property
    def name(self) -> str:
        return f"{self.cfg.prefill}P{self.cfg.decode}D"

    @property
    def goodput(self) -> float:
        if self.exact_goodput is not None:
            return self.exact_goodput
        return float(self.summary["goodput"])

    @property
    def goodput_per_node(self) -> float:
        return self.goodput / self.nodes

    def key(self) -> tuple[float, float, int, int, int]:
        # ties (per node rounded here) broken by the split itself, never by which of the
        # parallel simulations finished first: fewer prefill nodes, then the smaller batch
        return (-round(self.goodput_per_node, 6), -round(self.goodput, 6), self.nodes,
                self.cfg.prefill, self.cfg.prefill_max_batch)  # fmt: skip

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            "split": self.name,
            "prefill_max_batch": self.cfg.prefill_max_batch,
            "goodput": s["goodput"],
            "goodput_per_node": round(self.goodput_per_node, 4),
            "slo_attainment": round(self.attainment, 4),
            "ttft_ms_p50": s["ttft_ms_p50"],
            "ttft_ms_p99": s["ttft_ms_p99"],
            "tpot_ms_p50": s["tpot_ms_p50"],
            "tpot_ms_p99": s["tpot_ms_p99"],
            "recomputed": self.replacements,
        }


class Hopeless(Exception):
    """A simulation stopped early: enough of its requests already missed an SLO that it
    cannot reach the goodput per node asked of it."""

    def __init__(self, bound: float) -> None:
        self.bound = bound


@dataclass
class Stopped:
    """A split whose simulation stopped early, with what its goodput per node can reach at
    most (from the requests it had lost by then)."""

    cfg: SimConfig
    bound: float


def evaluate(
    specs: list[RequestSpec],
    cfg: SimConfig,
    slo: dict[str, float],
    progress: Callable[[float], None] | None = None,
    beat: tuple[float, float] = (-1.0, 0.0),
    work: Sequence[float] = (),
) -> Candidate | Stopped:
    """Simulate one split, or stop once it cannot reach `beat` = (a goodput per node, the
    least duration any split's run can have); `work` as for `missed`."""
    start = time.perf_counter()
    sim = ClusterSim(cfg)

    def watch(sim: ClusterSim) -> None:
        if progress is not None:
            progress(sim.finished / max(1, sim.total))
        best, least = beat
        if best <= 0:
            return
        first = min((r.record.sent for r in sim.arrived.values()), default=0.0)
        if sim.finished < sim.total:  # one still runs: the run lasts past now
            least = max(least, sim.now - first)
        could = sim.total - missed(sim, slo, work)
        bound = could / max(least, 1e-9) / (cfg.prefill + cfg.decode)
        if bound < best:
            raise Hopeless(bound)

    try:
        records = sim.run(specs, watch)
    except Hopeless as stop:
        return Stopped(cfg, stop.bound)
    summary = summarize(records, slo)
    good = sum(meets(r, slo) for r in records)
    # the summary's duration, unrounded (loadgen/metrics.py `summarize`)
    first = min((r.sent for r in records), default=0.0)
    duration = max(max((r.done for r in records), default=0.0) - first, 1e-9)
    return Candidate(
        cfg,
        summary,
        good / max(1, len(records)),
        sim.replacements,
        time.perf_counter() - start,
        sim.peak_prefill_batch,
        exact_goodput=good / duration,
    )


def missed(sim: ClusterSim, slo: dict[str, float], work: Sequence[float] = ()) -> int:
    """Requests that already missed an SLO, whatever happens next: finished without meeting
    them all, or with no first token still (or a late one) past the TTFT SLO, or decoding
    for longer than the TPOT SLO allows its tokens, or past the end-to-end SLO; and of those
    waiting for a prefill node, all but as many as the prefill nodes could still serve in
    time. `work`: each request's least prefill seconds (planner/bounds.py), by index."""
    ttft, tpot = slo.get("ttft", math.inf), slo.get("tpot", math.inf)
    e2e = slo.get("e2e", math.inf)
    now, count = sim.now, 0
    for r in sim.arrived.values():
        rec = r.record
        if rec.done or rec.error:  # ended (refused at arrival: done may be 0)
            count += not meets(rec, slo)
            continue
        first = rec.chunk_times[0] if rec.chunk_times else now
        # its TPOT is (end - first token) / (max_tokens - 1) at least (the sim ignores EOS);
        # one token has no TPOT (meets() passes it), however long its KV takes to land
        count += (
            first - rec.sent > ttft
            or now - rec.sent > e2e
            or (bool(rec.chunk_times) and r.spec.max_tokens > 1
                and now - first > tpot * (r.spec.max_tokens - 1))
        )  # fmt: skip
    if len(work) and math.isfinite(ttft):
        # every one waiting is due by now + ttft: in that time P nodes do P x ttft of work
        due = sorted(
            work[r.index]
            for r in sim.waiting.values()
            if not r.record.chunk_times and sim.now - r.record.sent <= ttft
        )
        room = sim.cfg.prefill * ttft
        served = int(np.searchsorted(np.cumsum(due), room, side="right")) if due else 0
        count += len(due) - served
    return count
