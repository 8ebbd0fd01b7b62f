"""Layer-wise KV sending, measured: how much of the transfer stays exposed after prefill.

The real SmolLM2 model (float32) prefills a prompt in this process while pdserve's sender
ships its KV (`--backend tcp` or zmq) to a decode-side intake in another process. Exposed
transfer = time from the end of the forward pass to the KvAck for the last layer.

Headline: the mean decode-ready time (prefill start to KvAck) over a shuffled sequence of
prompts with layer-wise sending always on, always off, and `--layerwise auto`
(prefill_node/layerwise.py); `auto_vs_best_fixed` is its ratio to the better fixed policy.
It also measures the per-layer framing overhead (`layerwise_overhead_ms`) and the prompt
length from which layer-wise pays (`suggested_threshold_tokens`, `crossover_tokens`), which
set `--layerwise-min-tokens`. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/overlap.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import zmq.asyncio

from benchmarks.cache_engine import CacheOnlyEngine
from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import PrefillWork
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.kv import listen_all, receivers_for
from pdserve.common.kv.base import Local
from pdserve.common.kv.intake import Intake, KvIntake
from pdserve.common.kv.sender import KvSender, Transfer
from pdserve.common.memtune import tune_malloc
from pdserve.common.model.config import load_model_config, resolve_model
from pdserve.common.node import host_identity
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import DecodeTarget
from pdserve.common.wire.transport import bound_address, make_socket
from pdserve.prefill_node.layerwise import LayerwiseRule

BLOCK = 16
MAX_TOKENS = 4096


def decode_main(ready: Any) -> None:
    tune_malloc()
    torch.set_num_threads(1)
    asyncio.run(_decode(ready))


async def _decode(ready: Any) -> None:
    layout = load_model_config(resolve_model(None))
    engine = CacheOnlyEngine(layout, MAX_TOKENS, BLOCK, torch.float32)
    sock = make_socket(zmq.asyncio.Context(), "node.data", "tcp://127.0.0.1:0", max_msg=1 << 30)
    blocks = list(range(engine.cache.num_blocks))[::-1]  # other block ids than the sender's

    async def admit(intake: Intake, first_token: int) -> None:
        return None

    address = bound_address(sock, "127.0.0.1")
    local = Local("overlap-decode", "elsewhere", "127.0.0.1", engine.kv_store, data_address=address)
    receivers = receivers_for(local)
    intake = KvIntake(
        sock,
        engine.kv_store,
        lambda h: blocks[: -(-len(h.prompt_ids) // BLOCK) + 1],  # type: ignore[arg-type]
        lambda b: None,
        admit,
        receivers,
    )
    ready.put((address, await listen_all(receivers, intake.landing)))
    await intake.run()


async def one_prefill(
    runner: ModelRunner,
    sender: KvSender,
    target: DecodeTarget,
    acked: asyncio.Queue[Transfer],
    n: int,
    layerwise: bool,
    rid: str,
    rule: LayerwiseRule | None = None,
) -> tuple[float, float]:
    """(exposed seconds after the forward pass, prefill start to decode-ready seconds). With
    a rule, the rule decides `layerwise` and learns from the outcome, as a prefill node's."""
    ids = [(i * 7919) % 40000 + 100 for i in range(n)]
    table = list(range(-(-n // BLOCK)))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    t = sender.begin(rid, target, ids, n, params, table)
    if rule is not None:
        layerwise = rule.decide(n, t.total_bytes).layerwise

    def prefill() -> float:
        hook = None
        if layerwise:

            def hook(layer: int) -> None:
                loop.call_soon_threadsafe(sender.push, t, layer, sender.stage(t, layer))

        runner.step([PrefillWork(rid, ids, 0, table, params)], [], hook)
        end = time.monotonic()
        if not layerwise:
            payloads = sender.stage_all(t)
            loop.call_soon_threadsafe(sender.push_all, t, payloads)
        return end

    prefill_end = await loop.run_in_executor(None, prefill)
    sender.done(t, 7)
    await acked.get()
    ready = time.monotonic()
    if rule is not None:
        rule.observe_pass(n, prefill_end - start, layerwise)
        rule.observe_tail(t.total_bytes, ready - prefill_end, layerwise)
    return ready - prefill_end, ready - start


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    runner = ModelRunner(
        EngineConfig(num_kv_blocks=MAX_TOKENS // BLOCK + 1, num_threads=args.threads)
    )
    ready: Any = mp.Queue()
    proc = mp.Process(target=decode_main, args=(ready,), daemon=True)
    proc.start()
    address, endpoints = ready.get(timeout=120)
    acked: asyncio.Queue[Transfer] = asyncio.Queue()

    async def on_refuse(rid: str, peer: str, why: str) -> None:
        raise RuntimeError(why)

    local = Local("overlap", host_identity(), "127.0.0.1", runner.kv_store, forced=args.backend)
    sender = KvSender(zmq.asyncio.Context(), local, on_ack=acked.put_nowait, on_refuse=on_refuse)
    target = DecodeTarget(
        node_id="decode", data_address=address, host_id="elsewhere", kv_endpoints=endpoints
    )
    counter = iter(range(10**6))

    async def med(n: int, layerwise: bool) -> tuple[float, float]:
        await one_prefill(runner, sender, target, acked, n, layerwise, f"w{next(counter)}")
        runs = [
            await one_prefill(runner, sender, target, acked, n, layerwise, f"r{next(counter)}")
            for _ in range(args.repeats)
        ]
        return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))

    result: dict[str, Any] = {
        "threads": args.threads,
        "backend": args.backend,
        "repeats": args.repeats,
    }
    # the headline: decode-ready time over a mixed sequence, per policy (prefill_node/
    # layerwise.py's rule starts cold here, exploring both modes, as a fresh node does)
    sizes = [64, 512, 1024, 2048] * args.sequence
    random.Random(0).shuffle(sizes)
    # warm the model and both send paths: else the policy measured first pays for them
    for layerwise in (True, False):
        await one_prefill(runner, sender, target, acked, 512, layerwise, f"warm{layerwise}")
    for policy in ("on", "off", "auto"):
        rule = LayerwiseRule(policy)
        ready = []
        for n in sizes:
            rid = f"s{next(counter)}"
            ready.append((await one_prefill(runner, sender, target, acked, n, False, rid, rule))[1])
        result[f"sequence_ready_ms_mean_{policy}"] = round(statistics.mean(ready) * 1000, 1)
        tail = ready[len(ready) // 2 :]  # the rule warm
        result[f"sequence_ready_ms_mean_second_half_{policy}"] = round(
            statistics.mean(tail) * 1000, 1
        )
    best = min(result["sequence_ready_ms_mean_on"], result["sequence_ready_ms_mean_off"])
    result["auto_vs_best_fixed"] = round(result["sequence_ready_ms_mean_auto"] / best, 3)
    if args.sequence_only:
        await sender.close()
        proc.terminate()
        return result
    for n in (256, 1024, 4000):
        exposed, _ = await med(n, True)
        serial, _ = await med(n, False)
        result[f"exposed_transfer_ms_{n}"] = round(exposed * 1000, 2)
        result[f"serial_transfer_ms_{n}"] = round(serial * 1000, 2)
    result["exposed_vs_serial_4000"] = round(
        result["exposed_transfer_ms_4000"] / result["serial_transfer_ms_4000"], 3
    )
    crossover = None
    for n in (16, 64, 256, 1024, 2048, 4000):
        _, ready_lw = await med(n, True)
        _, ready_end = await med(n, False)
        result[f"ready_ms_{n}"] = {
            "layerwise": round(ready_lw * 1000, 2),
            "at_end": round(ready_end * 1000, 2),
        }
        if crossover is None and ready_lw < ready_end:
            crossover = n
    result["crossover_tokens"] = crossover
    small = [result[f"ready_ms_{n}"] for n in (16, 64)]
    overhead = statistics.median(r["layerwise"] - r["at_end"] for r in small)
    per_token = result["serial_transfer_ms_4000"] / 4000
    result["layerwise_overhead_ms"] = round(overhead, 2)
    result["suggested_threshold_tokens"] = int(max(0.0, overhead) / per_token)
    await sender.close()
    proc.terminate()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=("tcp", "zmq"), default="tcp", help="cross-host path")
    ap.add_argument("--sequence", type=int, default=4, help="mixed sequence: rounds of 4 sizes")
    ap.add_argument("--sequence-only", action="store_true", help="skip the per-size sweep")
    args = ap.parse_args()
    tune_malloc()
    mp.set_start_method("spawn")
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
