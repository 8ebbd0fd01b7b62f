"""The P:D planner: the split of a node budget between prefill and decode that serves a
workload best, by simulation (planner/sim.py).

Objective: goodput per node (requests meeting every SLO per second, the load generator's
definition, divided by the nodes used), then total goodput, then fewer nodes. A budget is
a ceiling, not a target: for the workload as given (its arrival rate included), the planner
right-sizes, and a split that serves everything within SLO on fewer nodes beats a larger
one. Splits are tried by total size upward (every xPyD with x + y = n); once some split of
n nodes meets the SLOs for (nearly) every request, no larger one can do better per node
and the search stops. The best few splits are then tried with other prefill batch limits
(`--max-batch`, the on-demand accept rule's `bp`); a decode node always runs every sequence
it holds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from pdserve.loadgen.metrics import meets, summarize
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.sim import ClusterSim, SimConfig

SATURATED = 0.99  # SLO attainment past which more nodes cannot raise goodput per node
REFINE = 3  # splits tried with the other prefill batch limits


@dataclass
class Candidate:
    cfg: SimConfig
    summary: dict[str, Any]
    attainment: float  # share of requests meeting every SLO
    replacements: int  # preemptions re-placed (recomputed)
    seconds: float  # simulation wall time

    @property
    def nodes(self) -> int:
        return self.cfg.prefill + self.cfg.decode

    @property
    def goodput_per_node(self) -> float:
        return float(self.summary["goodput"]) / self.nodes

    def key(self) -> tuple[float, float, int]:
        return (-round(self.goodput_per_node, 6), -float(self.summary["goodput"]), self.nodes)

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            "split": f"{self.cfg.prefill}P{self.cfg.decode}D",
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


def evaluate(specs: list[RequestSpec], cfg: SimConfig, slo: dict[str, float]) -> Candidate:
    start = time.perf_counter()
    sim = ClusterSim(cfg)
    records = sim.run(specs)
    summary = summarize(records, slo)
    good = sum(meets(r, slo) for r in records)
    return Candidate(
        cfg, summary, good / max(1, len(records)), sim.replacements, time.perf_counter() - start
    )


def plan_splits(
    specs: list[RequestSpec],
    slo: dict[str, float],
    budget: int,
    base: SimConfig,
    batches: tuple[int, ...] = (),
) -> list[Candidate]:
    """Every split tried, best first (see the module's note for the order and the cut)."""
    if budget < 2:
        raise ValueError("a node budget of at least 2 (one prefill, one decode) is needed")
    tried: list[Candidate] = []
    for n in range(2, budget + 1):
        size = [
            evaluate(specs, dataclasses.replace(base, prefill=x, decode=n - x), slo)
            for x in range(1, n)
        ]
        tried += size
        if max(c.attainment for c in size) >= SATURATED:
            break
    tried.sort(key=Candidate.key)
    for c in tried[:REFINE]:
        for b in batches:
            if b != c.cfg.prefill_max_batch:
                tried.append(evaluate(specs, dataclasses.replace(c.cfg, prefill_max_batch=b), slo))
    tried.sort(key=Candidate.key)
    return tried
