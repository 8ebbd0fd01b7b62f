"""`pdserve plan`: the best prefill/decode split of a node budget for a workload and SLOs.

    pdserve plan --budget 8 --input-len 4000 --output-len 100 --rate 6 --num-requests 400 \\
        --slo ttft=1000,tpot=50 [--sim-profile GPU-MODEL] [--json]

The workload flags are `pdserve bench`'s (synthetic lengths and arrivals, or a Mooncake
trace): the workload planned is the one a benchmark would send. Prints the recommended
split with its predicted TTFT/TPOT p50/p99 and goodput, then the runners-up. While it
searches, a progress line on stderr shows each simulation in flight and the best split so
far; `--max-seconds` answers with the best found when the time is up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from pdserve.common.config import EngineConfig, GatewayConfig
from pdserve.common.flags import add_shared_flags
from pdserve.loadgen.bench import add_workload_flags, build_workload
from pdserve.loadgen.metrics import parse_slo
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.candidate import Candidate
from pdserve.planner.progress import Progress, cores
from pdserve.planner.search import plan_splits
from pdserve.planner.sim import SimConfig

# splits grow as budget^2 / 2 (bounded and sorted before the first simulation starts): 1024
# nodes is ~520k of them, seconds to bound; far beyond, the search would hang before its
# first output (and --max-seconds is no help there)
MAX_BUDGET = 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="best xPyD split of a node budget for a workload and SLOs (simulated)"
    )
    add_workload_flags(p)
    p.add_argument("--warmup", type=int, default=0,
                   help="as bench's: the workload's first N requests warm the cluster up, "
                        "not planned for (bench's N: the same measured requests)")  # fmt: skip
    p.add_argument("--budget", type=int, default=8,
                   help=f"most nodes (prefill + decode; at most {MAX_BUDGET})")  # fmt: skip
    # what the planner models of the serving commands: their flags, their defaults
    add_shared_flags(p, EngineConfig, ("sim_profile", "max_batch", "max_batch_tokens"))
    p.add_argument(
        "--try-max-batch",
        default="8,64",
        help="other prefill batch limits tried on the best splits (comma list; empty: none)",
    )
    add_shared_flags(p, EngineConfig, ("prefix_caching",))
    add_shared_flags(p, GatewayConfig, ("scheduler", "admission"))
    p.add_argument("--max-prefill", type=int, default=None, help="most prefill nodes")
    p.add_argument("--max-decode", type=int, default=None, help="most decode nodes")
    p.add_argument("--workers", type=int, default=0, help="simulations at once (0: one per core)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="answer with the best split found when this much time has passed",
    )
    p.add_argument("--show", type=int, default=5, help="runners-up printed")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not args.slo:
        raise ValueError("--slo is needed (e.g. ttft=1000,tpot=50): goodput counts against it")
    slo = parse_slo(args.slo)
    _check(args)
    specs = measured(build_workload(args), args.warmup)
    base = SimConfig(
        prefill=1,
        decode=1,
        profile=args.sim_profile,
        prefill_max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens,
        prefix_caching=args.prefix_caching == "on",
        policy=args.scheduler,
        admission=args.admission,
        ttft_slo=slo.get("ttft", math.inf),  # deadline order: as a gateway's --ttft-slo
    )
    batches = tuple(int(b) for b in args.try_max_batch.split(",") if b.strip())
    if any(b < 1 for b in batches):
        raise ValueError(f"--try-max-batch {args.try_max_batch!r}: limits of at least 1")
    start = time.perf_counter()
    line = Progress(sys.stderr, start) if not args.no_progress else None
    try:  # a ValueError (nothing to plan) ends the progress line before it is printed
        plan = plan_splits(
            specs,
            slo,
            args.budget,
            base,
            batches,
            max_prefill=args.max_prefill,
            max_decode=args.max_decode,
            workers=args.workers or cores(),
            max_seconds=args.max_seconds,
            progress=line,
        )
    finally:
        if line is not None:
            line.close()
    took = time.perf_counter() - start
    if not plan.ranked:
        print(f"no split simulated to its end within --max-seconds {args.max_seconds}")
        return 1
    if plan.ranked[0].goodput <= 0:  # not a recommendation: every split scored 0
        print(nothing_meets(plan.ranked[0], len(plan.ranked)))
        return 1
    rows = [c.row() for c in plan.ranked]
    if args.json:
        print(
            json.dumps(
                {
                    "recommended": rows[0],
                    "tried": rows,
                    "skipped_by_bound": plan.skipped,
                    "stopped_early": plan.cut,
                    "notes": plan.notes,
                    "finished": plan.finished,
                    "seconds": round(took, 2),
                }
            )
        )
        return 0
    best = rows[0]
    if not plan.finished:
        print(f"--max-seconds {args.max_seconds} ran out: the best split found so far")
    print(
        f"recommended: {best['split']} (prefill --max-batch {best['prefill_max_batch']}): "
        f"goodput {best['goodput']} req/s ({best['goodput_per_node']} per node), "
        f"{best['slo_attainment']:.1%} of requests within the SLOs; TTFT p50/p99 "
        f"{best['ttft_ms_p50']}/{best['ttft_ms_p99']} ms, TPOT p50/p99 "
        f"{best['tpot_ms_p50']}/{best['tpot_ms_p99']} ms"
    )
    keys = list(best)
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows[: args.show + 1]:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    for note in plan.notes:
        print(f"\n{note}")
    print(
        f"\n{len(rows)} configurations simulated in {took:.1f} s ({len(specs)} requests "
        f"each); {plan.cut} more stopped early once their missed requests showed they could "
        f"not win, {plan.skipped} more skipped: the cost model bounds their goodput per "
        "node below the recommendation's"
    )
    return 0


def nothing_meets(best: Candidate, tried: int) -> str:
    row = best.row()
    return (
        f"no split meets the SLOs: none of the {tried} simulated served a request within "
        f"them (the best, {row['split']}: TTFT p50 {row['ttft_ms_p50']} ms, TPOT p50 "
        f"{row['tpot_ms_p50']} ms); loosen the SLOs or lower the load"
    )


def _check(args: argparse.Namespace) -> None:
    """What would plan nothing (or search forever) is an error, not a recommendation."""
    if not 2 <= args.budget <= MAX_BUDGET:
        raise ValueError(f"--budget: 2 (one prefill, one decode) to {MAX_BUDGET} nodes")
    for name in ("max_prefill", "max_decode"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: at least 1 (leave it out: no limit)")
    if args.max_seconds is not None and not 0 < args.max_seconds < math.inf:
        raise ValueError("--max-seconds: a positive number of seconds (leave it out: no limit)")


def measured(specs: list[RequestSpec], warmup: int) -> list[RequestSpec]:
    """The requests bench measures with `--warmup`: all but the first `warmup`, their
    arrivals from the first of them (the lengths drawn after all arrivals, so a workload
    with warm-ups differs from one without: plan with bench's own `--warmup`)."""
    kept = specs[warmup:]
    base = kept[0].arrival if kept else 0.0
    return [dataclasses.replace(s, arrival=s.arrival - base) for s in kept]
