"""Engine speed on the embedded SmolLM2: prefill tok/s (500-token prompt) and aggregate
decode tok/s at batch 1, 8 and 32. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/engine.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import DecodeWork, PrefillWork
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def prefill_tok_s(runner: ModelRunner, n: int, repeats: int) -> float:
    ids = [(i * 7919) % 40000 + 100 for i in range(n)]
    table = list(range(-(-n // runner.block_size)))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runner.step([PrefillWork("p", ids, 0, table, GREEDY)], [])
        times.append(time.perf_counter() - start)
    return n / statistics.median(times[1:])  # first run warms up


def decode_tok_s(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int
) -> tuple[float, float]:
    """Tokens per second, the median of three timed runs of `steps` decode steps over the
    same batch; and the median single step in ms (what a served stream's ITL p50 is held
    to: a mean step would count the slow tail a median gap does not)."""
    runs = [_decode_run(runner, batch, prompt_len, steps) for _ in range(3)]
    tok_s = statistics.median(batch * len(times) / sum(times) for times in runs)
    return tok_s, 1000 * statistics.median(t for times in runs for t in times)


def _decode_run(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> list[float]:
    blocks_per_seq = -(-(prompt_len + steps + 1) // runner.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    last = []
    for i, table in enumerate(tables):
        ids = [(j * 31 + i * 101) % 40000 + 100 for j in range(prompt_len)]
        last += runner.step([PrefillWork(str(i), ids, 0, table, GREEDY)], [])
    pos = prompt_len
    for _ in range(3):  # warm-up steps
        last = runner.step(
            [], [DecodeWork(str(i), last[i], pos, tables[i], GREEDY) for i in range(batch)]
        )
        pos += 1
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        last = runner.step(
            [], [DecodeWork(str(i), last[i], pos, tables[i], GREEDY) for i in range(batch)]
        )
        times.append(time.perf_counter() - start)
        pos += 1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default="none", choices=["auto", "none", "int8", "int4"])
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--decode-context", type=int, default=128, help="prompt length before decode")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(
        EngineConfig(
            dtype=args.dtype,
            num_kv_blocks=2048,
            num_threads=args.threads,
            device=args.device,
            quantization=args.quantization,
            kv_shared_cache="off",
        )
    )
    result = {
        "dtype": args.dtype,
        "device": args.device,
        "quantization": runner.cfg.quantization,
        "threads": args.threads,
        "prefill_tok_s": round(prefill_tok_s(runner, args.prompt_len, 5), 1),
    }
    for b in (int(x) for x in args.batches.split(",")):
        tok_s, step_ms = decode_tok_s(runner, b, args.decode_context, args.steps)
        result[f"decode_tok_s_b{b}"] = round(tok_s, 1)
        result[f"decode_step_ms_b{b}_p50"] = round(step_ms, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
