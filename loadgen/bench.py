"""`pdserve bench`: build a seeded workload, run it against a URL, write and print results."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from pdserve.loadgen import workloads
from pdserve.loadgen.metrics import parse_slo, summarize
from pdserve.loadgen.runner import BenchConfig, run, write_results


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="run one seeded workload against a pdserve (or any OpenAI-compatible) URL"
    )
    p.add_argument(
        "--url", action="append", default=None,
        help="the server (default http://127.0.0.1:8000); several gateways of one cluster: "
        "repeat it or separate by commas, and the requests are spread over them in turn",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    add_workload_flags(p)
    p.add_argument("--concurrency", type=int, default=0, help="closed loop with N in flight")
    p.add_argument(
        "--stagger", type=float, default=0.0,
        help="closed loop: stream k starts k x this many seconds after the first",
    )  # fmt: skip
    p.add_argument(
        "--fresh-connections", action="store_true",
        help="a new connection per request (llama.cpp's server closes kept-alive ones)",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for requests.jsonl / summary.*")
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="completions: token-id prompts of exact length; chat: the same prompts as text "
        "in one user message (the server's template and tokenizer run)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="--endpoint chat: model whose tokenizer turns token ids into text (default: the "
        "embedded SmolLM2, the server's default model)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The workload and SLO flags, shared with `pdserve plan` (the same workload planned and
    measured)."""
    p.add_argument(
        "--workload",
        default="synthetic",
        choices=["synthetic", "shared-prefix", "sharegpt", "mooncake"],
    )
    p.add_argument("--dataset", default=None, help="sharegpt JSON or mooncake JSONL file")
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (0: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape k (1 = Poisson)")
    p.add_argument("--input-len", default="128", help="128 (fixed), or e.g. lognormal:512:0.5")
    p.add_argument("--output-len", default="64", help="as --input-len")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix workload")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix workload")
    p.add_argument("--time-scale", type=float, default=1.0, help="mooncake: stretch arrivals")
    p.add_argument("--length-scale", type=float, default=1.0, help="mooncake: scale lengths")
    p.add_argument("--slo", default="", help="ttft=MS,tpot=MS,e2e=MS for goodput")
    p.add_argument("--seed", type=int, default=0)


def build_workload(args: argparse.Namespace) -> list[workloads.RequestSpec]:
    # NaN passes every `<= 0` test: a NaN rate made every arrival time NaN (a hang)
    finite = 0 <= args.rate < math.inf and 0 < args.burstiness < math.inf
    if not (args.num_requests >= 1 and finite):
        raise ValueError("--num-requests >= 1, --rate >= 0 (0: all at once) and "
                         "--burstiness > 0, finite numbers")  # fmt: skip
    if not (0 < args.time_scale < math.inf and 0 < args.length_scale < math.inf):
        raise ValueError("--time-scale and --length-scale: positive finite numbers")
    # -1 started no sender (a run of nothing, "0 failed"); a negative warm-up measured the
    # last few requests only
    if getattr(args, "concurrency", 0) < 0 or getattr(args, "warmup", 0) < 0:
        raise ValueError("--concurrency and --warmup: 0 or more")
    n = args.num_requests + getattr(args, "warmup", 0)
    if args.workload == "synthetic":
        return workloads.synthetic(
            args.seed,
            n,
            args.rate,
            args.burstiness,
            workloads.LengthDist.parse(args.input_len),
            workloads.LengthDist.parse(args.output_len),
        )
    if args.workload == "shared-prefix":
        suffix = int(workloads.LengthDist.parse(args.input_len).mean)
        out = int(workloads.LengthDist.parse(args.output_len).mean)
        return workloads.shared_prefix(
            args.seed, n, args.rate, args.burstiness, args.groups, args.prefix_len, suffix, out
        )
    if not args.dataset:
        raise ValueError(f"--workload {args.workload} needs --dataset FILE")
    if args.workload == "sharegpt":
        return workloads.sharegpt(Path(args.dataset), args.seed, n, args.rate, args.burstiness)
    return workloads.mooncake(Path(args.dataset), args.seed, n, args.time_scale, args.length_scale)


def main(args: argparse.Namespace) -> int:
    specs = build_workload(args)
    if args.endpoint == "chat":
        from pdserve.common.model.tokenizer import Tokenizer

        specs = workloads.as_text(specs, Tokenizer.load(args.tokenizer).decode)
    cfg = BenchConfig(
        url=",".join(args.url or ["http://127.0.0.1:8000"]),
        model=args.model,
        concurrency=args.concurrency,
        warmup=args.warmup,
        ignore_eos=not args.no_ignore_eos,
        progress=not args.no_progress,
        endpoint=args.endpoint,
        fresh_connections=args.fresh_connections,
        stagger=args.stagger,
    )
    records = asyncio.run(run(specs, cfg))
    summary = summarize(records, parse_slo(args.slo))
    meta = {
        "command": " ".join(["pdserve", *sys.argv[1:]]),
        "workload": args.workload,
        "seed": args.seed,
        "rate": args.rate,
        "burstiness": args.burstiness,
        "concurrency": args.concurrency,
        "stagger": args.stagger,
        "endpoint": args.endpoint,
    }
    if args.out:
        write_results(Path(args.out), records, summary, meta)
    print(json.dumps(summary))
    return 0 if summary["completed"] else 1
