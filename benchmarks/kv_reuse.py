"""KV cache reuse across the cluster, measured: prefix caching, the cluster index, cache-aware
routing and cross-node fetch, each configuration against caching off in the same run.

    python -m benchmarks.kv_reuse torch --out docs/results/kv-reuse   # about 50 min, 2 cores
    python -m benchmarks.kv_reuse sim --out docs/results/kv-reuse     # about 5 min

torch: SmolLM2-135M in float32, 1P1D and 2P2D, a shared-prefix and a multi-turn workload,
with caching off, per node (cache-blind routing) and kv_aware (the index and
`--scheduler kv_aware`). sim: the Mooncake FAST'25 trace on the simulated 4P4D cluster, every
policy with caching on, with and without cross-node fetch. Reported: TTFT, prefill tokens
computed, hit rate, fetched tokens, goodput (docs/results/README.md §6).

Writes `STUDY.json` (the rows) and `STUDY.md` (their table) into `--out`, STUDY = torch or sim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from pdserve.loadgen.client import send
from pdserve.loadgen.compare import start_cluster, stop_cluster
from pdserve.loadgen.metrics import RequestRecord, parse_slo, summarize
from pdserve.loadgen.runner import BenchConfig, run
from pdserve.loadgen.workloads import RequestSpec, mooncake, random_tokens, shared_prefix

CONFIGS = {
    "off": ["--prefix-caching", "off", "--scheduler", "on_demand"],
    "per_node": ["--scheduler", "on_demand", "--cache-aware-routing", "off"],
    "kv_aware": ["--scheduler", "kv_aware"],
}
TORCH = ["--engine", "torch", "--num-kv-blocks", "2560", "--placement-timeout", "900"]
TOPOLOGIES = {
    "1P1D": ["--prefill", "1", "--decode", "1"],
    "2P2D": ["--prefill", "2", "--decode", "2"],
}
SIM = ["--engine", "sim", "--prefill", "4", "--decode", "4", "--sim-time-scale", "4"]
SIM += ["--max-batch", "4", "--placement-timeout", "120"]
SIM_POLICIES = ["on_demand", "round_robin", "jsq", "kv_aware"]


def cache_counters(url: str) -> dict[str, float]:
    """The cluster's prefix-cache counters (queries, hits, of them fetched), in tokens, as
    the gateway exports them."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {"queries": 0.0, "hits": 0.0, "fetched_tokens": 0.0}
    for line in text.splitlines():
        for key in values:
            if line.startswith(f"pdserve:cluster_prefix_cache_{key}_total "):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values


async def conversations(
    url: str, n: int, turns: int, first: int, question: int, output: int, gap: float, seed: int
) -> list[RequestRecord]:
    """`n` conversations started `gap` seconds apart; each turn waits for the last."""
    rng = np.random.default_rng(seed)
    openings = [random_tokens(rng, first) for _ in range(n)]
    questions = [[random_tokens(rng, question) for _ in range(turns)] for _ in range(n)]
    records: list[RequestRecord] = []

    async def one(c: int, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(c * gap)
        prompt = openings[c]
        for t in range(turns):
            spec = RequestSpec(0.0, prompt, output, len(prompt))
            rec = await send(session, url, None, spec, c * turns + t, True, 900, token_ids=True)
            records.append(rec)
            if not rec.ok or len(rec.token_ids) != output:
                return
            prompt = prompt + rec.token_ids + questions[c][t]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(c, session) for c in range(n)))
    return sorted(records, key=lambda r: r.index)


def measured(
    url: str, records: list[RequestRecord], before: dict[str, float], slo: dict[str, float]
) -> dict[str, Any]:
    time.sleep(2.0)  # the nodes' last heartbeats carry their counters to the gateway
    after = cache_counters(url)
    summary = summarize(records, slo)
    prompt = sum(r.prompt_tokens for r in records if r.ok)
    hits = after["hits"] - before["hits"]
    keys = ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_mean", "goodput", "completed", "failed")
    return {
        **{k: summary[k] for k in keys},
        "prompt_tokens": prompt,
        "computed_tokens": round(prompt - hits),
        "hit_rate": round(hits / prompt, 4) if prompt else 0.0,
        "fetched_tokens": round(after["fetched_tokens"] - before["fetched_tokens"]),
        "duration_s": summary["duration_s"],
    }


def one_run(
    up: list[str],
    startup: float,
    row: dict[str, Any],
    slo: dict[str, float],
    load: Callable[[str], list[RequestRecord]],
) -> dict[str, Any]:
    """A fresh cluster, `load(url)` against it, the row with what it measured."""
    proc, url, _ = start_cluster(up, startup)
    try:
        before = cache_counters(url)
        row = row | measured(url, load(url), before, slo)
    finally:
        stop_cluster(proc)
    print(json.dumps(row), flush=True)
    return row


def torch_study(args: argparse.Namespace) -> list[dict[str, Any]]:
    def shared(url: str) -> list[RequestRecord]:
        specs = shared_prefix(args.seed, args.requests, args.rate, 1.0, 16, 2000, 100, 16)
        return asyncio.run(run(specs, BenchConfig(url=url, progress=False, timeout=900)))

    def turns(url: str) -> list[RequestRecord]:
        return asyncio.run(conversations(url, 8, 4, 512, 64, 32, args.gap, args.seed))

    return [
        one_run(
            [*TORCH, *TOPOLOGIES[topo], *CONFIGS[name]],
            600,
            {"topology": topo, "workload": workload, "config": name},
            parse_slo(""),
            shared if workload == "shared-prefix" else turns,
        )
        for topo in args.topologies
        for workload in args.workloads
        for name in args.configs
    ]


def sim_study(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = mooncake(
        Path(args.trace), 3, args.sim_requests, time_scale=args.time_scale, length_scale=0.125
    )

    def replay(url: str) -> list[RequestRecord]:
        return asyncio.run(run(specs, BenchConfig(url=url, progress=False, timeout=300)))

    # (policy, caching, fetch): fetch "-" where caching is off (the flag stays at its default)
    runs = [(p, "on", f) for f in ("on", "off") for p in SIM_POLICIES] + [("on_demand", "off", "-")]
    return [
        one_run(
            [
                *SIM,
                "--scheduler",
                policy,
                "--prefix-caching",
                caching,
                "--kv-fetch",
                fetch.strip("-") or "on",
            ],
            120,
            {"policy": policy, "caching": caching, "fetch": fetch},
            parse_slo("ttft=2000,tpot=100"),
            replay,
        )
        for policy, caching, fetch in runs
    ]


def table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", choices=["torch", "sim"])
    p.add_argument("--out", default="docs/results/kv-reuse")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=48, help="torch shared-prefix requests")
    p.add_argument("--rate", type=float, default=0.125, help="torch shared-prefix arrivals/s")
    p.add_argument("--gap", type=float, default=4.0, help="seconds between conversations")
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    p.add_argument("--workloads", nargs="+", default=["shared-prefix", "multi-turn"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--trace", default="../shared/traces/mooncake_synthetic_trace.jsonl")
    p.add_argument("--time-scale", type=float, default=0.2, help="sim: trace time x this")
    p.add_argument("--sim-requests", type=int, default=1000, help="sim: trace rows replayed")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = torch_study(args) if args.study == "torch" else sim_study(args)
    (out / f"{args.study}.json").write_text(json.dumps(rows, indent=2) + "\n")
    keys = list(rows[0]) if rows else []
    (out / f"{args.study}.md").write_text(table(rows, keys) + "\n")


if __name__ == "__main__":
    main()
