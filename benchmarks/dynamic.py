"""Dynamic configuration on the real sim cluster (H100 x Llama-3.1-8B, 4 nodes): live role
switching against every fixed split, and selective disaggregation against its baselines.

    python -m benchmarks.dynamic --out docs/results/dynamic            # about 60 min, 2 cores
    python -m benchmarks.dynamic --out DIR --only switching|selective

switching: a workload that shifts halfway from prefill-heavy to decode-heavy (and `diurnal`,
one compressed day of both), run on 1P3D, 2P2D, 3P1D and 2P2D with `--role-switching on`.
selective: mixed prompt lengths on 2P2D at rising rates with `--local-prefill` off, always,
256 and adaptive. The workloads, SLOs and figures are in docs/results/README.md §8.

The cluster runs `--sim-time-scale S` (default 4), so that the Python overhead of nodes,
gateway and client stays small beside a modelled step; arrivals and SLOs are stretched by S
and reported times divided by it: every figure is in the modelled GPU's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.common.costmodel import DEFAULT_PROFILE
from pdserve.loadgen.compare import start_cluster, stop_cluster
from pdserve.loadgen.metrics import RequestRecord, meets, parse_slo, summarize
from pdserve.loadgen.runner import BenchConfig, run
from pdserve.loadgen.workloads import LengthDist, RequestSpec, synthetic

BASE = ["--engine", "sim", "--sim-profile", DEFAULT_PROFILE, "--placement-timeout", "900"]
SWITCH_SLO = "ttft=1000,tpot=15"
SELECTIVE_SLO = "ttft=1000,tpot=20"
HALF = 300  # requests per phase of the shifting workload


def shifting() -> list[RequestSpec]:
    first = synthetic(1, HALF, 18.0, 1.0, LengthDist("fixed", 4000), LengthDist("fixed", 50))
    second = synthetic(2, HALF, 24.0, 1.0, LengthDist("fixed", 200), LengthDist("fixed", 1000))
    start = first[-1].arrival + 1 / 18.0
    return first + [dataclasses.replace(s, arrival=s.arrival + start) for s in second]


def diurnal(period: float = 30.0, seed: int = 4) -> list[RequestSpec]:
    """One compressed day: long-in work (4,000 / 50) arrives at 18 cos^2(pi t / T) req/s,
    chat-like work (200 / 1,000) at 24 sin^2(pi t / T): prefill-heavy at both ends, decode-
    heavy at noon, the total rate swinging between 18 and 24 req/s and the mix with it.
    An inhomogeneous Poisson process (thinning of a 24 req/s one)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    specs: list[RequestSpec] = []
    t = 0.0
    while True:
        t += rng.exponential(1 / 42.0)
        if t >= period:
            return specs
        phase = np.pi * t / period
        long_rate, chat_rate = 18 * np.cos(phase) ** 2, 24 * np.sin(phase) ** 2
        u = rng.uniform(0, 42.0)
        if u < long_rate:
            n, out = 4000, 50
        elif u < long_rate + chat_rate:
            n, out = 200, 1000
        else:
            continue
        specs.append(RequestSpec(t, rng.integers(1000, 40000, n).tolist(), out, n))


class Watcher:
    """Polls the gateway's /health: each node's role over time (pool sizes)."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.samples: list[tuple[float, int, int]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    roles = list(json.loads(resp.read())["nodes"].values())
                self.samples.append(
                    (time.monotonic() - self.start, roles.count("prefill"), roles.count("decode"))
                )
            except OSError:
                pass
            time.sleep(0.5)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def one_run(
    specs: list[RequestSpec], up: list[str], scale: float, watch: bool = False
) -> tuple[list[RequestRecord], dict[str, Any]]:
    stretched = [dataclasses.replace(s, arrival=s.arrival * scale) for s in specs]
    args = [*BASE, "--sim-time-scale", str(scale), *up]
    try:
        proc, url, _ = start_cluster(args, timeout=300)
    except RuntimeError:  # once, here, a cluster never printed that it was up: one retry
        proc, url, _ = start_cluster(args, timeout=300)
    watcher = Watcher(url) if watch else None
    extra: dict[str, Any] = {}
    try:
        records = asyncio.run(run(stretched, BenchConfig(url=url, progress=False)))
        extra = {
            "switches": _metric(url, "pdserve:role_switches_total"),
            "migrated": _metric(url, "pdserve:kv_migrations_total"),
            "replaced": _metric(url, "pdserve:request_replacements_total"),
            "local": _metric(url, "pdserve:local_prefills_total"),
        }
    finally:
        if watcher is not None:
            watcher.stop.set()
            extra["pools"] = [(round(t / scale, 2), p, d) for t, p, d in watcher.samples]
        stop_cluster(proc)
    return records, extra


def figures(records: list[RequestRecord], slo_text: str, scale: float) -> dict[str, Any]:
    wide = {k: v * scale for k, v in parse_slo(slo_text).items()}
    s = summarize(records, wide)
    keys = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99")
    return {
        "goodput": round(s["goodput"] * scale, 4),
        "slo_attainment": round(sum(meets(r, wide) for r in records) / len(records), 4),
        "failed": s["failed"],
        **{k: round(s[k] / scale, 3) if s[k] is not None else None for k in keys},
    }


def switching(
    scale: float,
    out: Path,
    only: list[str] | None = None,
    workload: str = "shifting",
    day: float = 30.0,
) -> list[dict[str, Any]]:
    specs = shifting() if workload == "shifting" else diurnal(day)
    half = HALF if workload == "shifting" else sum(s.arrival < day / 2 for s in specs)
    runs = {
        "1P3D": ["--prefill", "1", "--decode", "3"],
        "2P2D": ["--prefill", "2", "--decode", "2"],
        "3P1D": ["--prefill", "3", "--decode", "1"],
        "2P2D+switching": [
            "--prefill", "2", "--decode", "2", "--role-switching", "on",
            "--tpot-slo", str(0.015 * scale), "--sizing-window", str(1 * scale),
            "--switch-hold", str(1 * scale), "--switch-dwell", str(5 * scale),
        ],
    }  # fmt: skip
    rows, timelines = [], {}
    for name, up in runs.items():
        if only and name not in only:
            continue
        records, extra = one_run(specs, up, scale, watch=name.endswith("switching"))
        row = {
            "config": name,
            **figures(records, SWITCH_SLO, scale),
            "phase1_goodput": figures(records[:half], SWITCH_SLO, scale)["goodput"],
            "phase2_goodput": figures(records[half:], SWITCH_SLO, scale)["goodput"],
            **{k: v for k, v in extra.items() if k != "pools"},
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        timelines[name] = (records, extra.get("pools", []))
    name = workload if workload == "shifting" or day == 30.0 else f"{workload}-{day:g}"
    plot_switching(out, timelines, scale, f"{name}.png")
    return rows


def plot_switching(out: Path, timelines: dict[str, Any], scale: float, filename: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    slo = {k: v * scale for k, v in parse_slo(SWITCH_SLO).items()}
    for name, (records, pools) in timelines.items():
        start = min(r.sent for r in records)
        done = sorted((r.done - start) / scale for r in records if meets(r, slo))
        width = 2.0
        edges = [i * width for i in range(int((done[-1] if done else 0) / width) + 2)]
        rate = [sum(a <= t < a + width for t in done) / width for a in edges]
        bottom.plot(edges, rate, label=name)
        if pools:
            top.step([t for t, _, _ in pools], [p for _, p, _ in pools], where="post",
                     label=f"{name}: prefill nodes")  # fmt: skip
            top.step([t for t, _, _ in pools], [d for _, _, d in pools], where="post",
                     label=f"{name}: decode nodes", linestyle="--")  # fmt: skip
    top.set_ylabel("nodes")
    top.legend(fontsize=7)
    bottom.set_ylabel("goodput (req/s, 2 s bins)")
    bottom.set_xlabel("modelled seconds since the first request")
    bottom.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / filename, dpi=110)
    plt.close(fig)


def selective(
    scale: float, rates: list[float], modes: list[str], count: int = 120
) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        specs = synthetic(
            3, count, rate, 1.0, LengthDist("lognormal", 600, 1.2), LengthDist("fixed", 150)
        )
        for mode in modes:
            up = ["--prefill", "2", "--decode", "2", "--local-prefill", mode]
            up += ["--tpot-slo", str(0.020 * scale)]
            records, extra = one_run(specs, up, scale)
            row = {"rate": rate, "local_prefill": mode, **figures(records, SELECTIVE_SLO, scale)}
            row["replaced"] = extra["replaced"]
            row["local_share"] = round(extra["local"] / len(specs), 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def plot_selective(out: Path, rows: list[dict[str, Any]]) -> None:
    """Goodput and ITL p99 against the arrival rate, one line per --local-prefill mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["local_prefill"] for r in rows):
        mine = [r for r in rows if r["local_prefill"] == mode]
        rates = [r["rate"] for r in mine]
        left.plot(rates, [r["goodput"] for r in mine], marker="o", label=mode)
        right.plot(rates, [r["itl_ms_p99"] for r in mine], marker="o", label=mode)
    left.set_ylabel("goodput (req/s within both SLOs)")
    right.set_ylabel("ITL p99 (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="--local-prefill")
    fig.tight_layout()
    fig.savefig(out / "selective.png", dpi=110)
    plt.close(fig)


def table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=float, default=4.0)
    p.add_argument("--only", choices=["switching", "diurnal", "selective"], default=None)
    p.add_argument("--configs", nargs="*", default=None, help="switching: only these runs")
    p.add_argument("--rates", nargs="*", type=float, default=[24.0, 48.0, 72.0, 96.0],
                   help="selective")  # fmt: skip
    p.add_argument("--modes", nargs="*", default=["off", "always", "256", "adaptive"])
    p.add_argument("--requests", type=int, default=400, help="selective: requests per run")
    p.add_argument("--day", type=float, default=30.0, help="diurnal: modelled seconds per day")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = []
    if args.only in (None, "switching"):
        rows = switching(args.scale, out, args.configs)
        (out / "switching.json").write_text(json.dumps(rows, indent=1))
        keys = ["config", "goodput", "phase1_goodput", "phase2_goodput", "slo_attainment",
                "failed", "switches", "migrated", "replaced", "tpot_ms_p99"]  # fmt: skip
        report.append("## Live role switching\n\n" + table(rows, keys))
    if args.only in (None, "diurnal"):
        rows = switching(args.scale, out, args.configs, "diurnal", args.day)
        name = "diurnal" if args.day == 30.0 else f"diurnal-{args.day:g}"
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
        keys = ["config", "goodput", "phase1_goodput", "phase2_goodput", "slo_attainment",
                "failed", "switches", "migrated", "replaced", "tpot_ms_p99"]  # fmt: skip
        report.append("## Live role switching, a compressed day\n\n" + table(rows, keys))
    if args.only in (None, "selective"):
        rows = selective(args.scale, args.rates, args.modes, args.requests)
        (out / "selective.json").write_text(json.dumps(rows, indent=1))
        plot_selective(out, rows)
        keys = ["rate", "local_prefill", "goodput", "slo_attainment", "itl_ms_p99",
                "ttft_ms_p99", "tpot_ms_p99", "local_share", "failed"]  # fmt: skip
        report.append("## Selective disaggregation\n\n" + table(rows, keys))
    text = "\n\n".join(report)
    (out / "dynamic.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
