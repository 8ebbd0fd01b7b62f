"""The token and KV paths under realistic concurrency: hundreds of streams on sim clusters.

The sim engine's tokens are a pure function of (seed, position), so the exact text every
request must return is known here, whatever node produced which token."""

from __future__ import annotations

import pytest

from tests.e2e.streams import run_streams, sim_text


@pytest.mark.parametrize(
    ("backend", "scheduler"),
    [("tcp", "on_demand"), ("shm", "kv_aware")],
    ids=["tcp-on_demand", "shm-kv_aware"],
)
def test_hundreds_of_streams_in_identical_groups_return_identical_exact_text(
    make_cluster, tokenizer, backend, scheduler
):
    """Tokens of one request come from the prefill node (the first) and the decode node (the
    rest) over two sockets; whichever the gateway reads first, the text is in token order.
    kv_aware sends each group where its prefix is cached and holds the rest at the gateway
    while that node is busy: the same exact text."""
    cluster = make_cluster(
        prefill=2,
        decode=2,
        engine="sim",
        gateway_flags=("--scheduler", scheduler),
        node_flags=("--sim-time-scale", "0.02", "--kv-backend", backend),
    )
    groups, per_group, max_tokens = 40, 8, 12
    bodies, expected = [], []
    for g in range(groups):
        prompt = list(range(1000 + 100 * g, 1000 + 100 * g + 16 + g))
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": 7 + g,
            "ignore_eos": True,
            "stream": True,
        }
        bodies += [body] * per_group
        expected += [sim_text(tokenizer, prompt, 7 + g, max_tokens)] * per_group
    results = run_streams(cluster.url, bodies, timeout=60)
    failed = [r for r in results if not r.ok]
    assert not failed, failed[:3]
    wrong = [i for i, (r, want) in enumerate(zip(results, expected, strict=True)) if r.text != want]
    assert not wrong, [(results[i].text, expected[i]) for i in wrong[:3]]
