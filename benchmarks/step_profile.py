"""Where a decode step's time goes, on the embedded SmolLM2.

    .venv/bin/python -m benchmarks.step_profile --batch 1 --threads 2

Times the parts of `ModelRunner.step` for one decode batch in turn (building the step's
tensors, the 30 layers, the LM head, sampling), then runs torch's profiler over whole steps
and prints its table of operators by self CPU time. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine import GREEDY
from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import DecodeWork, PrefillWork
from pdserve.common.engine.quant import SmallBatchLinear
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.engine.sampler import sample


def timed(fn: Callable[[], object], n: int) -> float:
    """Median milliseconds of fn over n runs, after one warm-up."""
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--cpu-kernels", default="auto", help="auto: fused C kernels; off: eager ops")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=15, help="profiler table rows")
    p.add_argument(
        "--dense-from", type=int, default=0,
        help="quantized layers run dense from this many rows (0: quant.DENSE_FROM)",
    )  # fmt: skip
    args = p.parse_args()
    cfg = EngineConfig(
        dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
        cpu_kernels=args.cpu_kernels,
        num_kv_blocks=args.batch * (args.context // 16 + 4), max_model_len=2048,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    if args.dense_from:
        for m in runner.model.modules():
            if isinstance(m, SmallBatchLinear) and m.dense_from:
                m.dense_from = args.dense_from
    per_seq = args.context // 16 + 4
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]
    last: list[int] = []
    for i, table in enumerate(tables):
        ids = [(j * 31 + i * 101) % 40000 + 100 for j in range(args.context)]
        last += runner.step([PrefillWork(str(i), ids, 0, table, GREEDY)], [])
    work = [DecodeWork(str(i), last[i], args.context, tables[i], GREEDY) for i in range(args.batch)]

    # each part alone (the decode step rewrites the same position: the cost is the same)
    meta = runner._metadata([], work)
    token_ids = torch.tensor([w.token_id for w in work])
    positions = torch.tensor([w.position for w in work])
    model, cache = runner.model, runner.kv_cache
    hidden = model(token_ids, positions, meta, cache)
    logits = model.logits(hidden)
    parts = {
        "step_ms": timed(lambda: runner.step([], work), args.steps),
        "metadata_ms": timed(lambda: runner._metadata([], work), args.steps),
        "layers_ms": timed(lambda: model(token_ids, positions, meta, cache), args.steps),
        "lm_head_ms": timed(lambda: model.logits(hidden), args.steps),
        "sample_ms": timed(lambda: sample(logits, [GREEDY] * args.batch, [1] * args.batch), 50),
    }
    parts["other_ms"] = parts["step_ms"] - sum(v for k, v in parts.items() if k != "step_ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            runner.step([], work)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    line = {k: round(v, 3) for k, v in parts.items()}
    print(json.dumps({"batch": args.batch, "numerics": cfg.numerics, **line}))


if __name__ == "__main__":
    main()
