"""The prefix cache's disk tier under load (sim engine, real processes): hundreds of streams
over a few shared prompt prefixes, on a node whose cache holds a fraction of them, so
prefixes go to disk and come back (read ahead off the node's event loop: a sequence waits
for its blocks while the others run). Every stream ends with its text, and every block is
freed. The bytes themselves are checked against the single process on the torch engine
(tests/e2e/test_correctness.py)."""

from __future__ import annotations

import urllib.request

from pdserve.common.wire.transport import free_port
from tests.e2e.conftest import start_cluster, wait_for
from tests.e2e.streams import run_streams, sim_text

GROUPS, STREAMS, TOKENS = 12, 240, 12


def _tier(port: int, event: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("pdserve:kv_tier_blocks")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'event="{event}"' in line)


def test_hundreds_of_streams_over_prefixes_evicted_to_disk_all_end_with_their_text(
    tokenizer, tmp_path
):
    port = free_port()
    # 12 prefixes of 16 blocks (192) and 16 sequences running in 160 blocks: prefixes go to
    # disk and back. At modelled H100 speed and a small simulated KV, loading a block beats
    # recomputing it (the tiers' measured rule), so they do come back
    flags = ("--sim-time-scale", "1", "--sim-kv-scale", "0.001", "--num-kv-blocks", "160",
             "--max-batch", "16", "--kv-disk-cache-gb", "0.5",
             "--kv-disk-cache-dir", str(tmp_path))  # fmt: skip
    cluster = start_cluster(prefill=0, decode=0, colocated=1, engine="sim", node_flags=flags,
                            extra={"colocated-0": ("--metrics-port", str(port))})  # fmt: skip
    try:
        bodies = []
        for i in range(STREAMS):
            shared = list(range(1000 + 300 * (i % GROUPS), 1256 + 300 * (i % GROUPS)))
            bodies.append({"prompt": [*shared, 50 + i], "max_tokens": TOKENS, "seed": i,
                           "temperature": 1.0, "ignore_eos": True, "stream": True})  # fmt: skip
        results = run_streams(cluster.url, bodies, timeout=120)
        failed = [(i, r.status, r.error) for i, r in enumerate(results) if not r.ok]
        assert not failed, failed[:3]
        for body, r in zip(bodies, results, strict=True):
            assert r.text == sim_text(tokenizer, body["prompt"], body["seed"], TOKENS)
        assert _tier(port, "spilled") > 0 and _tier(port, "disk_hits") > 0
        assert _tier(port, "corrupt") == 0
        in_use = ("pdserve:kv_blocks", {"role": "colocated", "state": "in_use"})
        assert wait_for(lambda: cluster.metric(in_use[0], **in_use[1]) == 0, timeout=10)
    finally:
        cluster.stop()
