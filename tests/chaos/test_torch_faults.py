"""The kill/restart chaos run on the real model, shorter: 1P2D SmolLM2 (float32) streaming
greedy chat answers while the decode node holding most of them is SIGKILLed and started
again. Every answer, the lost ones recomputed elsewhere from prompt + the tokens already
sent, equals the single-process engine's text token for token; no KV is left in use."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.transport import free_port
from tests.chaos.test_node_faults import DECODES, _running
from tests.conftest import CHAT_PROMPTS, chat_ids, make_engine
from tests.e2e.conftest import wait_for
from tests.e2e.streams import run_streams

# Streams of 32 tokens still run when the victim is killed (the kill waits for 3 running on
# the decode nodes, and replacements are asserted); 128 blocks (2,048 tokens) hold all six
# streams with room, and each node zeroes a smaller cache at start than --kv-cache-gb 0.25
MAX_TOKENS = 32


def test_greedy_text_survives_a_killed_decode_node(make_cluster, smol_runner, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = make_engine(smol_runner, tokenizer, prefix_caching="off").generate(prompts, greedy)
    ports = {d: free_port() for d in DECODES}
    cluster = make_cluster(
        prefill=1,
        decode=2,
        engine="torch",
        node_flags=("--num-kv-blocks", "128"),
        extra={d: ("--metrics-port", str(port)) for d, port in ports.items()},
    )
    bodies = [
        {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
         "stream": True}
        for p in prompts
    ]  # fmt: skip
    results: list = []
    load = threading.Thread(target=lambda: results.extend(run_streams(cluster.url, bodies, 120)))
    load.start()

    # the victim is chosen by the nodes' own /metrics, read the instant before the kill (a
    # heartbeat's report may be stale by then), and it must hold sequences when killed
    running: dict[str, int] = {}

    def busy() -> bool:
        running.update({d: _running(ports[d]) for d in DECODES})
        return sum(running.values()) >= 3

    assert wait_for(busy, timeout=60, interval=0.01), f"fewer than 3 streams ran: {running}"
    victim = max(DECODES, key=lambda d: running[d])
    cluster.procs[2 + int(victim[-1])].kill()  # procs: gateway, prefill-0, decode-0, decode-1
    killed = time.monotonic()
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "decode"]
    cmd += ["--gateway", cluster.control, "--node-id", victim, *cluster.node_flags]
    assert wait_for(lambda: cluster.metric("pdserve:request_replacements_total") > 0, 10)
    cluster.procs.append(subprocess.Popen(cmd))  # started again once it was seen gone
    load.join(180)
    assert not load.is_alive()
    for body, exp, got in zip(bodies, expected, results, strict=True):
        assert got.ok, got.error
        assert got.text == exp.text, f"a {len(body['prompt'])}-token prompt diverged"
    print(
        f"\ntorch chaos: {len(results)} greedy streams exact, "
        f"{cluster.metric('pdserve:request_replacements_total'):.0f} re-placed after "
        f"{victim} was killed ({time.monotonic() - killed:.1f} s to the last token)"
    )
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, 15)
