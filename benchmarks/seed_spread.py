"""The default placement policy against the queueing baselines over several seeded workloads:
per rate, the ratio of each metric to each baseline's on every seed, their geometric mean and
the spread over the seeds (docs/results/README.md, section 1).

    python -m benchmarks.seed_spread docs/results/sim-4p4d docs/results/sim-4p4d-seed1[2-6] \
        --out docs/results/sim-4p4d-seeds.md

Each folder is a `pdserve compare` report of one seed. A ratio is oriented so that under 1
means the default is better (goodput: baseline / default; TTFT: default / baseline). The
noise of a cell is the spread of that ratio over the seeds: the mean of its logarithm with a
one-sided 95 % Student-t bound (the seeds are independent workloads of one distribution).
A cell fails when the default is worse beyond that noise: the bound's lower end above 1 (for
TTFT p50, above 1.10: within 10 % of the better baseline is the issue's allowance).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

# one-sided 95 % Student-t quantiles by degrees of freedom (scipy is not a dependency)
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860}
# (summary key, higher is better, the allowance on the geometric mean)
METRICS = {
    "goodput": ("goodput", True, 1.0),
    "TTFT p99": ("ttft_ms_p99", False, 1.0),
    "TTFT p50": ("ttft_ms_p50", False, 1.10),
}


def load(folder: Path) -> dict[tuple[str, float], dict[str, Any]]:
    rows = json.loads((folder / "summary.json").read_text())
    return {(r["configuration"], float(r["rate"])): r for r in rows}


def ratio(default: float, base: float, higher_better: bool) -> float:
    """Under 1: the default is better."""
    return base / default if higher_better else default / base


def cell(ratios: list[float], allowance: float) -> dict[str, Any]:
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1)) if n > 1 else 0.0
    # past 8 degrees of freedom the normal quantile: a slightly narrower bound, the strict side
    half = T95.get(n - 1, 1.645) * sd / math.sqrt(n) if n > 1 else 0.0
    low, high = math.exp(mean - half), math.exp(mean + half)
    gmean = math.exp(mean)
    ok = low <= allowance  # worse than the allowance beyond the seeds' noise: fails
    return {
        "gmean": gmean, "low": low, "high": high, "min": min(ratios), "max": max(ratios),
        "better_on": sum(r <= 1.0 for r in ratios), "n": n, "ok": ok,
    }  # fmt: skip


def spread(folders: list[Path], default: str, baselines: list[str]) -> list[dict[str, Any]]:
    """Every folder must hold every configuration at the default's rates: a seed missing a
    run would silently drop out of that cell's spread."""
    runs = [load(f) for f in folders]
    rates = sorted({rate for run in runs for (name, rate) in run if name == default})
    for folder, run in zip(folders, runs, strict=True):
        missing = [(n, r) for n in (default, *baselines) for r in rates if (n, r) not in run]
        if missing:
            raise ValueError(f"{folder}: no run of {missing}")
    out = []
    for rate in rates:
        for label, (key, higher, allowance) in METRICS.items():
            row: dict[str, Any] = {"rate": rate, "metric": label}
            per_base = {
                base: [ratio(run[(default, rate)][key], run[(base, rate)][key], higher)
                       for run in runs]
                for base in baselines
            }  # fmt: skip
            if label == "TTFT p50":  # within 10 % of the better baseline, seed by seed:
                # the better baseline gives the larger ratio
                best = [max(pair) for pair in zip(*per_base.values(), strict=True)]
                row["best"] = cell(best, allowance)
            else:
                for base, ratios in per_base.items():
                    row[base] = cell(ratios, allowance)
            out.append(row)
    return out


def markdown(rows: list[dict[str, Any]], folders: list[Path], default: str) -> str:
    lines = [
        f"`{default}` against the baselines over {len(folders)} seeded workloads "
        f"({', '.join(f.name for f in folders)}): geometric mean of the per-seed ratio "
        "(under 1: the default better), its one-sided 95 % bound over the seeds, the range, "
        "and on how many seeds the default was at least as good.",
        "",
        "| rate | metric | against | ratio (gmean) | 95 % bound | range | as good on | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for base, c in row.items():
            if base in ("rate", "metric"):
                continue
            against = "the better baseline" if base == "best" else base
            lines.append(
                f"| {row['rate']:g} | {row['metric']} | {against} | {c['gmean']:.2f} | "
                f"{c['low']:.2f}-{c['high']:.2f} | {c['min']:.2f}-{c['max']:.2f} | "
                f"{c['better_on']} of {c['n']} | {'yes' if c['ok'] else '**no**'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--default", default="on_demand")
    p.add_argument("--baselines", nargs="+", default=["round_robin", "jsq"])
    p.add_argument("--out", type=Path, help="markdown table (printed either way)")
    args = p.parse_args()
    rows = spread(args.folders, args.default, args.baselines)
    text = markdown(rows, args.folders, args.default)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
