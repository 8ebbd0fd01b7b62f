"""pdserve against llama.cpp's server: the same CPU, the same GGUF, the same client, one run.

    .venv/bin/python -m benchmarks.vs_llama --out results/vs-llama

Each server in turn (llama-server with 16 slots and flash attention; pdserve colocated; pdserve
1P1D; 1P1D with prefill under SCHED_IDLE) serves closed-loop streams of random token-id
prompts (256 tokens, 128 output tokens; no shared prefix) at 1 and 16 streams, the 16 both
all at once and staggered (prompts arriving mid-decode, as in a service). Each pdserve figure
is reported as a ratio to llama-server's from the same run. Without a llama-server
(benchmarks/llama_server.py) it measures pdserve alone; one that crashes on start runs with
--no-repack, and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks import llama_server
from pdserve.common.model.config import resolve_model
from pdserve.common.numerics import cpu_description
from pdserve.common.wire.transport import free_port
from pdserve.loadgen.compare import start_cluster, stop_cluster
from pdserve.loadgen.metrics import summarize
from pdserve.loadgen.runner import BenchConfig, run
from pdserve.loadgen.workloads import LengthDist, synthetic

KEYS = ("output_throughput", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "itl_ms_max", "failed")
TARGETS = {  # (server, case, key): (bound, "min" = at least bound x llama-server's)
    ("colocated", "16", "output_throughput"): (1.0, "min"),
    ("colocated", "16 staggered", "output_throughput"): (1.0, "min"),
    ("colocated", "1", "output_throughput"): (0.8, "min"),
    ("1p1d", "16", "itl_ms_p99"): (0.5, "max"),
    ("1p1d", "16 staggered", "itl_ms_p99"): (0.5, "max"),
    ("1p1d-idle", "16", "itl_ms_p99"): (0.5, "max"),
    ("1p1d-idle", "16 staggered", "itl_ms_p99"): (0.5, "max"),
}


def cases(args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """(label, streams, stagger seconds): one stream alone; more both at once and staggered."""
    out = []
    for s in args.streams:
        out.append((str(s), s, 0.0))
        if s > 1:
            out.append((f"{s} staggered", s, args.stagger))
    return out


def measure(url: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results = {}
    for n, (label, streams, stagger) in enumerate(cases(args)):
        # a seed per case: no prompt repeats across cases (either server's prompt cache
        # would answer a repeat without prefilling it)
        specs = synthetic(
            args.seed * 1000 + n, streams * (args.rounds + 1), 0.0, 1.0,
            LengthDist("fixed", args.prompt), LengthDist("fixed", args.output),
        )  # fmt: skip
        bench = BenchConfig(
            url=url, concurrency=streams, warmup=streams, progress=False,
            fresh_connections=True, stagger=stagger,
        )  # fmt: skip
        records = asyncio.run(run(specs, bench))
        results[label] = {k: summarize(records)[k] for k in KEYS}
    return results


def pdserve_args(kind: str, args: argparse.Namespace) -> list[str]:
    common = ["--engine", "torch", "--dtype", args.dtype, "--quantization", args.quantization]
    common += ["--max-batch", "16", "--max-model-len", "2048", "--kv-cache-gb", "0.25"]
    if kind == "colocated":
        return ["--prefill", "0", "--decode", "0", "--colocated", "1", *common,
                "--num-threads", str(args.threads)]  # fmt: skip
    # 1P1D on one host: both nodes take every core (--prefill-threads, --decode-threads), which
    # makes `pdserve up` wait passively; "1p1d-idle" also runs prefill under SCHED_IDLE
    priority = "idle" if kind == "1p1d-idle" else args.prefill_priority
    spin = [] if args.decode_spin is None else ["--decode-spin", str(args.decode_spin)]
    return ["--prefill", "1", "--decode", "1", *common, "--kv-backend", args.kv_backend,
            "--prefill-threads", str(args.prefill_threads or args.threads),
            "--decode-threads", str(args.decode_threads or args.threads),
            "--prefill-nice", str(args.prefill_nice), "--prefill-priority", priority,
            *spin]  # fmt: skip


def run_pdserve(kind: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    proc, url, _ = start_cluster(pdserve_args(kind, args), timeout=600)
    try:
        return measure(url, args)
    finally:
        stop_cluster(proc)


def run_llama(binary: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    port = free_port()
    gguf = Path(str(resolve_model(None).path))
    log = Path(args.out) / "llama-server.log"
    proc, flags = llama_server.start(binary, gguf, port, args.threads, 16, 2048, log)
    if flags:
        args.llama_note = f"llama-server: {llama_server.NO_REPACK_WHY}."
        print(args.llama_note, flush=True)
    try:
        return measure(f"http://127.0.0.1:{port}", args)
    finally:
        llama_server.stop(proc)


def report(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        f"# pdserve against llama-server ({cpu_description()}, "
        f"{args.threads} threads, {args.prompt}-token prompts, {args.output} output tokens, "
        f"pdserve --dtype {args.dtype} --quantization {args.quantization})",
        "",
        "| server | streams | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | ITL max ms "
        "| failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for server, by_streams in results.items():
        for s, row in by_streams.items():
            cells = " | ".join(str(row[k]) for k in KEYS)
            lines.append(f"| {server} | {s} | {cells} |")
    if note := getattr(args, "llama_note", ""):
        lines += ["", note]
    ref = results.get("llama-server")
    if ref:
        lines += ["", "Targets (ratio to llama-server in this run):", ""]
        for (server, s, key), (bound, kind) in TARGETS.items():
            if server not in results or s not in results[server] or s not in ref:
                continue
            sign = ">=" if kind == "min" else "<="
            value, against = results[server][s][key], ref[s][key]
            if value is None or not against:  # a side without the figure (all failed)
                lines.append(f"- {server} {key} at {s} streams: n/a (target {sign} {bound}x)")
                continue
            ratio = value / against
            ok = ratio >= bound if kind == "min" else ratio <= bound
            lines.append(
                f"- {server} {key} at {s} streams: {ratio:.2f}x (target {sign} {bound}x): "
                f"{'met' if ok else 'NOT met'}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results/vs-llama")
    p.add_argument("--only", default="llama-server,colocated,1p1d,1p1d-idle")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--rounds", type=int, default=3, help="requests per stream, after a warm-up")
    p.add_argument("--stagger", type=float, default=0.5, help="seconds between stream starts")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-threads", type=int, default=0, help="1P1D; 0: --threads")
    p.add_argument("--decode-threads", type=int, default=0, help="1P1D; 0: --threads")
    p.add_argument("--prefill-nice", type=int, default=0, help="1P1D: the prefill node's nice")
    p.add_argument("--prefill-priority", default="normal", help="1P1D: normal or idle")
    p.add_argument("--decode-spin", type=int, default=None, help="1P1D: pdserve up's, if given")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument(
        "--kv-backend", default="auto",
        help="1P1D's KV transfer; auto, pdserve's default, is shared memory on one host "
        "(measured, 1P1D idle, 16 lock-step streams: ITL p99 57.6 and 58.5 ms, tcp 72.7)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-build", action="store_true", help="use llama-server only if found")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.streams = [int(s) for s in args.streams.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for server in args.only.split(","):
        start = time.monotonic()
        if server == "llama-server":
            binary = llama_server.find_or_build(not args.no_build, out / "llama-build.log")
            if isinstance(binary, str):
                print(f"llama-server skipped: {binary}", flush=True)
                continue
            results[server] = run_llama(binary, args)
        else:
            results[server] = run_pdserve(server, args)
        print(json.dumps({server: results[server], "s": round(time.monotonic() - start)}),
              flush=True)  # fmt: skip
        # after each server: a later one failing loses none of the figures measured
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, args)
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
