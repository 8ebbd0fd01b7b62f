"""What serving adds to a batch-1 decode step: the engine's own step against the ITL one
stream sees through the gateway, colocated and 1P1D, alternating in one run.

    .venv/bin/python -m benchmarks.serving_overhead --rounds 3

Each round measures, in turn: the engine alone (`benchmarks/engine.py`'s batch-1 decode in a
child process, at the context a served stream decodes at on average: prompt + half the
output), then `pdserve up` colocated and 1P1D (both nodes on every core, as `vs_llama`), one
closed-loop stream of `--prompt`-token prompts and `--output` tokens; and 1P1D with the
prefill engine under SCHED_IDLE ("1p1d-idle", `--prefill-priority idle`). The overhead is ITL p50
over the engine's step in the same round; the report gives every round and the medians, with
the CPU it ran on. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from pdserve.common.numerics import cpu_description
from pdserve.loadgen.compare import start_cluster, stop_cluster
from pdserve.loadgen.metrics import summarize
from pdserve.loadgen.runner import BenchConfig, run
from pdserve.loadgen.workloads import LengthDist, synthetic

ROOT = Path(__file__).resolve().parent.parent


def engine_step_cmd(args: argparse.Namespace) -> list[str]:
    """engine.py's batch-1 decode from the prompt's end over `--output` steps (after its 3
    warm-up steps): the contexts a served stream decodes at, prompt + half the output on
    average. (It started at prompt + half the output: ~67 tokens deeper than served, a
    slower reference step, which read as less overhead.)"""
    return [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--dtype", args.dtype,
            "--quantization", args.quantization, "--threads", str(args.threads),
            "--prompt-len", "16", "--decode-context", str(args.prompt),
            "--steps", str(args.output), "--batches", "1"]  # fmt: skip


def engine_step_ms(args: argparse.Namespace) -> float:
    """The engine's batch-1 decode step in ms, the median step (as the served ITL is its
    p50), in a child process (its own OpenMP team)."""
    cmd = engine_step_cmd(args)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["decode_step_ms_b1_p50"])


def served_itl_ms(kind: str, args: argparse.Namespace, seed: int) -> float:
    common = ["--engine", "torch", "--dtype", args.dtype, "--quantization", args.quantization,
              "--max-batch", "16", "--max-model-len", "2048", "--kv-cache-gb", "0.25"]  # fmt: skip
    if kind == "colocated":
        up = ["--prefill", "0", "--decode", "0", "--colocated", "1", *common,
              "--num-threads", str(args.threads)]  # fmt: skip
    else:
        up = ["--prefill", "1", "--decode", "1", *common, "--prefill-threads",
              str(args.threads), "--decode-threads", str(args.threads)]  # fmt: skip
        if kind == "1p1d-idle":  # prefill under SCHED_IDLE: the decode node keeps spinning
            up += ["--prefill-priority", "idle"]
        if args.decode_spin is not None:
            up += ["--decode-spin", str(args.decode_spin)]
    proc, url, _ = start_cluster(up, timeout=600)
    try:
        specs = synthetic(seed, args.requests + 1, 0.0, 1.0, LengthDist("fixed", args.prompt),
                          LengthDist("fixed", args.output))  # fmt: skip
        bench = BenchConfig(url=url, concurrency=1, warmup=1, progress=False)
        itl = summarize(asyncio.run(run(specs, bench)))["itl_ms_p50"]
        if itl is None:  # every request failed: no figure, and no report built on one
            raise RuntimeError(f"{kind}: no request completed (see the cluster's log)")
        return float(itl)
    finally:
        stop_cluster(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=4, help="per round and server, after one")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--only", default="colocated,1p1d,1p1d-idle", help="servers, comma-separated")
    p.add_argument("--decode-spin", type=int, default=None, help="1P1D: pdserve up's, if given")
    p.add_argument("--out", default="", help="folder for report.md and results.json")
    args = p.parse_args()
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be at least 1")
    rounds = []
    for r in range(args.rounds):
        row = {"engine_step_ms": engine_step_ms(args)}
        for kind in args.only.split(","):
            row[f"{kind}_itl_ms"] = served_itl_ms(kind, args, seed=100 * r + len(row))
            row[f"{kind}_overhead"] = row[f"{kind}_itl_ms"] / row["engine_step_ms"] - 1
        rounds.append(row)
        print(json.dumps(row), flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result = {"cpu": cpu_description(), "machine": platform.machine(), "rounds": rounds,
              "median": medians}  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        lines = [f"# Serving overhead at batch 1 ({result['cpu']}, {args.threads} threads, "
                 f"{args.prompt}-token prompts, {args.output} output tokens)", "",
                 "| round | engine step ms | colocated ITL p50 ms | overhead | 1P1D ITL p50 ms "
                 "| overhead | 1P1D idle ITL p50 ms | overhead |",
                 "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for i, row in enumerate([*rounds, medians]):
            name = str(i + 1) if i < len(rounds) else "median"
            cells = [f"{row['engine_step_ms']:.2f}"]
            for kind in ("colocated", "1p1d", "1p1d-idle"):
                if f"{kind}_itl_ms" in row:
                    cells += [f"{row[f'{kind}_itl_ms']:.2f}", f"{row[f'{kind}_overhead']:+.1%}"]
                else:
                    cells += ["", ""]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        (out / "report.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
