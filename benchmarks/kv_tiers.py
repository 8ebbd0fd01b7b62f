"""Prefix-cache tiers, round trip: blocks read out of the engine's cache into the host pool or
the disk tier and loaded back, in bytes/s, against recomputing the same tokens with the same
engine in the same run (SmolLM2-135M, float32, this CPU). It justifies the load rule of
`common/engine/tiers.py`: load when bytes / measured bandwidth < tokens x measured prefill
time per token, starting from guesses of 2 GB/s (host) and 200 MB/s (disk).

    python -m benchmarks.kv_tiers --tokens 2048 --repeats 3

The disk figures are read through the page cache unless `--cold` may drop it (root; the
kernel's `drop_caches`): say which when quoting them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import PrefillWork
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.engine.tiers import TierStore
from pdserve.common.sampling import SamplingParams


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="drop the page cache before disk loads")
    p.add_argument("--out", default="", help="also write the result (JSON) to this file")
    args = p.parse_args()
    runner = ModelRunner(
        EngineConfig(num_kv_blocks=args.tokens // 16 + 8, num_threads=args.threads)
    )
    bs = runner.block_size
    blocks = list(range(args.tokens // bs))
    prompt = np.random.default_rng(0).integers(1000, 40000, len(blocks) * bs).tolist()
    work = PrefillWork("bench", prompt, 0, blocks, SamplingParams(max_tokens=1, temperature=0.0))
    runner.step(
        [PrefillWork("warm", prompt[:64], 0, blocks[:4], SamplingParams(temperature=0.0))], []
    )
    recompute: list[float] = []
    host_load: list[float] = []
    disk_load: list[float] = []
    host_put: list[float] = []
    disk_put: list[float] = []
    cold = False
    for _ in range(args.repeats):
        started = time.perf_counter()
        runner.step([work], [])
        recompute.append(time.perf_counter() - started)
        saved = [runner.kv_store.read_block(b) for b in blocks]  # what eviction hands the tiers
        nbytes = sum(len(d) for d in saved)
        with tempfile.TemporaryDirectory() as folder:
            host = TierStore(2 * nbytes)
            disk = TierStore(0, 2 * nbytes, folder)
            for store, puts in ((host, host_put), (disk, disk_put)):
                started = time.perf_counter()  # eviction: read the block out, store it
                for b in blocks:
                    store.put(b.to_bytes(16, "big"), runner.kv_store.read_block(b))
                store.writer.flush()  # the disk tier writes on a thread: timed to the end
                puts.append(time.perf_counter() - started)
            for store, loads in ((host, host_load), (disk, disk_load)):
                if store is disk and args.cold:
                    cold = drop_page_cache()
                started = time.perf_counter()
                for b in blocks:
                    back = store.take(b.to_bytes(16, "big"))
                    assert back is not None and back == saved[b]
                    runner.kv_store.write_block(b, back)
                loads.append(time.perf_counter() - started)
            disk.close()
    med = statistics.median
    gbs = lambda s: round(nbytes / med(s) / 1e9, 3)  # noqa: E731
    result = {
        "tokens": len(prompt),
        "kv_bytes": nbytes,
        "recompute_s": round(med(recompute), 4),
        "recompute_ms_per_block": round(med(recompute) / len(blocks) * 1000, 3),
        "host_put_GBps": gbs(host_put),
        "host_load_GBps": gbs(host_load),
        "host_load_ms_per_block": round(med(host_load) / len(blocks) * 1000, 4),
        "disk_put_GBps": gbs(disk_put),
        "disk_load_GBps": gbs(disk_load),
        "disk_load_ms_per_block": round(med(disk_load) / len(blocks) * 1000, 4),
        "disk_cold": cold,
        "recompute_over_host_load": round(med(recompute) / med(host_load), 1),
        "recompute_over_disk_load": round(med(recompute) / med(disk_load), 1),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
