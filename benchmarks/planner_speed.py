"""How long `pdserve plan` takes on a large conversation-shaped trace, and whether its
recommendation still predicts the cluster it plans.

    python -m benchmarks.planner_speed --out docs/results/planner-speed   # ~15 min, 2 cores

The trace is a seeded Mooncake-format file of 12,031 turns shaped like Mooncake's
conversation trace (sessions of 1-5 turns, each prompt the previous one's plus new tokens).
It is planned as a user would (`--workload mooncake --dataset FILE`) at 2,000 requests on 16
nodes, 10,000 on 128, and 10,000 at 10x the rate; then the real sim cluster runs the
recommended split of the first `--measure` requests, measured goodput beside predicted
(target: within 5 %). Writes planner_speed.json and planner_speed.md into --out
(docs/results/README.md §7b).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.planner import measure
from pdserve.common.costmodel import DEFAULT_PROFILE
from pdserve.common.numerics import cpu_description
from pdserve.loadgen.metrics import parse_slo
from pdserve.loadgen.workloads import mooncake
from pdserve.planner.progress import cores
from pdserve.planner.search import plan_splits
from pdserve.planner.sim import ClusterSim, SimConfig

SLO = "ttft=2000,tpot=50"
PROFILE = DEFAULT_PROFILE
CASES = [  # (requests, budget, per-role ceiling, arrival-time scale)
    (2000, 16, None, 1.0),
    (10000, 128, 64, 1.0),
    (10000, 128, 64, 0.1),
]


def conversation_trace(path: Path, rows: int = 12031, rate: float = 3.3, seed: int = 0) -> None:
    """Write the conversation-shaped trace (see the module's note)."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    next_hash, t = 0, 0.0
    while len(out) < rows:
        t += rng.exponential(1.0 / rate)
        context: list[int] = []
        at = t
        for turn in range(int(rng.integers(1, 6))):
            add = int(rng.integers(4000, 6000)) if turn == 0 else int(rng.integers(600, 1500))
            length = len(context) * 512 + add
            blocks = -(-length // 512)
            while len(context) < blocks:
                context.append(next_hash)
                next_hash += 1
            output = int(max(8, rng.lognormal(np.log(450), 0.5)))
            out.append(
                {
                    "timestamp": int(at * 1000),
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": context[:blocks],
                }
            )
            at += rng.exponential(30.0)  # the user reads and types
            context = context[: length // 512]  # the next turn continues its full blocks
    out.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in out[:rows]))


def plan_case(trace: Path, n: int, budget: int, ceiling: int | None, scale: float) -> dict:
    specs = mooncake(trace, 0, n, scale)
    start = time.perf_counter()
    plan = plan_splits(
        specs,
        parse_slo(SLO),
        budget,
        SimConfig(1, 1, PROFILE),
        (8, 64),
        max_prefill=ceiling,
        max_decode=ceiling,
        workers=cores(),
        max_seconds=600,
    )
    took = time.perf_counter() - start
    best = plan.ranked[0]
    row = {
        "requests": n,
        "budget": budget,
        "ceiling": f"{ceiling}P{ceiling}D" if ceiling else None,
        "time_scale": scale,
        "seconds": round(took, 1),
        "finished": plan.finished,
        "recommended": best.row(),
        "simulated": len(plan.ranked),
        "stopped_early": plan.cut,
        "skipped_by_bound": plan.skipped,
        "sim_seconds_max": round(max(c.seconds for c in plan.ranked), 1),
    }
    print(json.dumps(row), flush=True)
    return row


def runs_vs_steps(trace: Path) -> dict:
    specs = mooncake(trace, 0, 400, 0.1)
    out: dict[str, Any] = {}
    records = []
    for runs in (False, True):
        sim = ClusterSim(SimConfig(3, 2, PROFILE, decode_runs=runs))
        start = time.perf_counter()
        records.append(sim.run(specs))
        out["runs" if runs else "steps"] = {
            "seconds": round(time.perf_counter() - start, 2),
            "events": sim.events_done,
        }
    a, b = records
    out["same_records"] = all(
        (x.chunk_times, x.done) == (y.chunk_times, y.done) for x, y in zip(a, b, strict=True)
    )
    print(json.dumps(out), flush=True)
    return out


def accuracy(trace: Path, n: int, scale: float) -> dict:
    specs = mooncake(trace, 0, n, 1.0)
    slo = parse_slo(SLO)
    plan = plan_splits(specs, slo, 16, SimConfig(1, 1, PROFILE), workers=cores())
    best = plan.ranked[0]
    measured = measure(specs, slo, best.cfg, scale)
    predicted = best.row()
    row = {
        "requests": n,
        "split": predicted["split"],
        "predicted_goodput": predicted["goodput"],
        "measured_goodput": measured["goodput"],
        "error": round(predicted["goodput"] / measured["goodput"] - 1, 4)
        if measured["goodput"]
        else None,
        "predicted": predicted,
        "measured": measured,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--measure", type=int, default=400, help="requests run on the cluster")
    p.add_argument("--scale", type=float, default=4.0, help="--sim-time-scale of the cluster")
    p.add_argument("--cases", default="0,1,2", help="which of CASES to plan")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "conversation_trace.jsonl"
    conversation_trace(trace)
    result: dict[str, Any] = {"cpu": cpu_description(), "cores": cores(), "slo": SLO}
    result["runs_vs_steps"] = runs_vs_steps(trace)
    picked = [CASES[int(i)] for i in args.cases.split(",") if i.strip()]
    result["plans"] = [plan_case(trace, *case) for case in picked]
    if args.measure:
        result["accuracy"] = accuracy(trace, args.measure, args.scale)
    trace.unlink()  # seeded: regenerated by the next run
    (out / "planner_speed.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"CPU: {result['cpu']}, {result['cores']} cores; SLO {SLO}",
        "",
        "| requests | budget | time scale | seconds | recommended | simulated | stopped early "
        "| skipped by bound |",
        "|" + "---|" * 8,
    ]
    for r in result["plans"]:
        rec = r["recommended"]
        lines.append(
            f"| {r['requests']} | {r['ceiling'] or r['budget']} | {r['time_scale']} | "
            f"{r['seconds']} | {rec['split']} ({rec['slo_attainment']:.1%} in SLO) | "
            f"{r['simulated']} | {r['stopped_early']} | {r['skipped_by_bound']} |"
        )
    (out / "planner_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
