"""Load generator: seeded workloads, metric math, and metrics against a server whose delays
are known exactly (the metric-truth test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.loadgen import workloads
from pdserve.loadgen.metrics import RequestRecord, meets, parse_slo, summarize
from pdserve.loadgen.runner import BenchConfig, run

TTFT, STEP, TOKENS = 0.20, 0.05, 8  # seconds, seconds, output tokens per request


def test_workloads_are_seeded_and_exact():
    dist = workloads.LengthDist.parse("lognormal:300:0.4")
    a = workloads.synthetic(7, 200, 5.0, 1.0, dist, workloads.LengthDist.parse("fixed:32"))
    b = workloads.synthetic(7, 200, 5.0, 1.0, dist, workloads.LengthDist.parse("fixed:32"))
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(len(s.prompt) == s.prompt_len and s.max_tokens == 32 for s in a)
    c = workloads.synthetic(8, 200, 5.0, 1.0, dist, workloads.LengthDist.parse("fixed:32"))
    assert [s.prompt for s in a] != [s.prompt for s in c]


def test_gamma_arrivals_keep_the_rate_and_burstiness_clumps():
    rng = np.random.default_rng(0)
    poisson = np.diff(workloads.arrivals(rng, 20000, rate=10.0, burstiness=1.0))
    bursty = np.diff(workloads.arrivals(rng, 20000, rate=10.0, burstiness=0.5))
    assert abs(poisson.mean() - 0.1) < 0.005 and abs(bursty.mean() - 0.1) < 0.005
    # coefficient of variation: 1 for Poisson, sqrt(1/k) for gamma shape k
    assert abs(poisson.std() / poisson.mean() - 1.0) < 0.05
    assert abs(bursty.std() / bursty.mean() - 2**0.5) < 0.08
    assert not workloads.arrivals(rng, 5, rate=0, burstiness=1).any()


def test_length_distributions():
    rng = np.random.default_rng(1)
    uni = workloads.LengthDist.parse("uniform:100:20").sample(rng, 5000)
    assert uni.min() >= 80 and uni.max() <= 120 and abs(uni.mean() - 100) < 1
    norm = workloads.LengthDist.parse("normal:500:50").sample(rng, 5000)
    assert abs(norm.mean() - 500) < 3 and abs(norm.std() - 50) < 3
    with pytest.raises(ValueError):
        workloads.LengthDist.parse("zipf:3")
    assert workloads.LengthDist.parse("128") == workloads.LengthDist.parse("fixed:128")
    with pytest.raises(ValueError):
        workloads.LengthDist.parse("-5")


def test_chat_prompts_are_the_token_prompts_as_text(tokenizer):
    specs = workloads.synthetic(
        1, 5, 0, 1.0, workloads.LengthDist.parse("64"), workloads.LengthDist.parse("8")
    )
    texts = workloads.as_text(specs, tokenizer.decode)
    assert [t.prompt for t in texts] == [tokenizer.decode(s.prompt) for s in specs]
    assert all(isinstance(t.prompt, str) and t.prompt_len == 64 for t in texts)
    # it re-tokenizes to about the same length
    assert all(abs(len(tokenizer.encode(t.prompt, False)) - 64) <= 8 for t in texts)


def test_shared_prefix_and_mooncake_replay_share_exactly_where_told(tmp_path):
    specs = workloads.shared_prefix(
        3, 40, 0, 1.0, groups=2, prefix_len=64, suffix_len=8, output_len=4
    )
    prefixes = {tuple(s.prompt[:64]) for s in specs}
    assert len(prefixes) == 2 and len({tuple(s.prompt) for s in specs}) == 40
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 9]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = workloads.mooncake(trace, 0, 10, time_scale=0.5, length_scale=0.25)
    assert (a.prompt_len, b.prompt_len, a.max_tokens) == (300, 275, 2)
    assert a.prompt[:256] == b.prompt[:256] and a.prompt[256:275] != b.prompt[256:275]
    assert (a.arrival, b.arrival) == (0.0, 1.0)


def test_summary_math_and_goodput():
    recs = []
    for i, (ttft, gap) in enumerate([(0.1, 0.02), (0.3, 0.04)]):
        r = RequestRecord(index=i, sent=10.0, output_tokens=3)
        r.chunk_times = [10.0 + ttft + k * gap for k in range(3)]
        r.done = r.chunk_times[-1]
        recs.append(r)
    recs.append(RequestRecord(index=2, sent=10.0, error="boom", done=10.5))
    s = summarize(recs, parse_slo("ttft=200,tpot=30"))
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["ttft_ms_max"] == pytest.approx(300.0)
    assert s["tpot_ms_mean"] == pytest.approx(30.0)
    assert s["itl_ms_p50"] == pytest.approx(30.0)  # pooled gaps: 20, 20, 40, 40
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(1 / 0.5)  # only the first meets both SLOs
    assert s["good"] == 1 and s["slo_attainment"] == round(1 / 3, 4)  # the error too
    with pytest.raises(ValueError):
        parse_slo("latency=3")


async def fake_completions(request: web.Request) -> web.StreamResponse:
    """A server with exactly known timing: first token after TTFT, then one per STEP. The
    deadlines are absolute, so a loaded host's wake-up lag delays a token but does not add
    to every later one (with relative sleeps it did, and the ITL grew by it)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    for i in range(n):
        await asyncio.sleep(max(0.0, start + TTFT + i * STEP - loop.time()))
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0}
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextlib.asynccontextmanager
async def completions_server(handler=fake_completions) -> AsyncIterator[str]:
    """A real HTTP server answering /v1/completions with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_metrics_match_a_server_with_known_delays():
    async with completions_server() as url:
        specs = workloads.synthetic(
            0,
            12,
            20.0,
            1.0,
            workloads.LengthDist.parse("fixed:16"),
            workloads.LengthDist.parse(f"fixed:{TOKENS}"),
        )
        records = await run(specs, BenchConfig(url=url, warmup=2, progress=False))
    s = summarize(records)
    assert s["completed"] == 10 and s["failed"] == 0
    assert all(r.output_tokens == TOKENS for r in records)
    truth = {"ttft": TTFT, "tpot": STEP, "itl": STEP, "e2e": TTFT + (TOKENS - 1) * STEP}
    # the server sleeps at least these; the client reads them later by its own lag (a few
    # ms idle, more on a loaded host). A wrong definition is further off: a gap per token,
    # not per gap, 12 % low; the first token's wait counted in the ITL, 37 % high
    for name, seconds in truth.items():
        for stat in ("mean", "p50"):
            got = s[f"{name}_ms_{stat}"] / 1000
            assert 0.95 * seconds <= got <= 1.25 * seconds, (name, stat, got, seconds)


def test_sharegpt_file_gives_prompts_and_reply_sized_outputs(tmp_path):
    data = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me a joke about cats."},
                {"from": "gpt", "value": "x" * 400},
            ]
        },
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {
            "conversations": [
                {"from": "human", "value": "Summarise Hamlet."},
                {"from": "gpt", "value": "y" * 40},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    specs = workloads.sharegpt(path, seed=1, n=20, rate=2.0, burstiness=1.0, max_output=64)
    assert {s.prompt for s in specs} == {"Tell me a joke about cats.", "Summarise Hamlet."}
    assert {s.max_tokens for s in specs} == {64, 10}  # reply length / 4, capped
    assert specs == workloads.sharegpt(path, seed=1, n=20, rate=2.0, burstiness=1.0, max_output=64)
    path.write_text("[]")
    with pytest.raises(ValueError, match="no conversations"):
        workloads.sharegpt(path, seed=1, n=5, rate=1.0, burstiness=1.0)


async def test_closed_loop_staggers_stream_starts_and_can_use_a_connection_per_request():
    """--stagger: stream k's first request leaves k x stagger s after stream 0's; with
    --fresh-connections every request opens its own connection (llama.cpp's server closes
    kept-alive ones), so the server sees as many peers as requests."""
    peers: list[int] = []

    async def counting(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])  # client port
        return await fake_completions(request)

    async with completions_server(counting) as url:
        specs = workloads.synthetic(
            1, 8, 0.0, 1.0, workloads.LengthDist.parse("8"), workloads.LengthDist.parse("8")
        )
        cfg = BenchConfig(
            url=url, concurrency=4, progress=False, stagger=0.1, fresh_connections=True
        )
        records = await run(specs, cfg)
    assert len(records) == 8 and all(r.ok for r in records)
    firsts = sorted(r.sent for r in records)[:4]
    gaps = np.diff(firsts)
    assert all(0.09 <= g <= 0.2 for g in gaps), gaps  # a stream starts every 0.1 s (each
    # request takes 0.55 s, so the first four sends are the four streams' first requests)
    assert len(set(peers)) == 8  # a fresh connection (client port) per request


def test_compare_passes_yaml_on_off_as_the_flags_spell_them(tmp_path) -> None:
    from pdserve.loadgen.compare import load_config, up_arg

    path = tmp_path / "study.yaml"
    up_line = "    up: [--prefill-ahead, on, --prefix-caching, off, --max-batch, 4]\n"
    path.write_text("configurations:\n  - name: a\n    rates: [1]\n" + up_line)
    up = load_config(path)["configurations"][0]["up"]
    assert up[1] is True  # what YAML makes of a bare on
    assert [up_arg(a) for a in up] == [
        "--prefill-ahead",
        "on",
        "--prefix-caching",
        "off",
        "--max-batch",
        "4",
    ]


async def _garbage(request: web.Request) -> web.StreamResponse:
    """Every other request: a data line that is not JSON, or an error given as a string."""
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    bad = b"data: {not json\n\n" if len(body["prompt"]) % 2 else b'data: {"error": "busy"}\n\n'
    await resp.write(bad)
    return resp


async def test_a_request_that_fails_strangely_fails_alone_not_the_run():
    """A non-JSON data line, an error given as a string, or asyncio's own timeout on Python
    3.10 escaped send() and ended the whole run's gather: every record lost."""
    async with completions_server(_garbage) as url:
        specs = workloads.synthetic(
            0, 6, 0.0, 1.0,
            workloads.LengthDist.parse("uniform:16:4"), workloads.LengthDist.parse("fixed:4"),
        )  # fmt: skip
        records = await run(specs, BenchConfig(url=url, warmup=0, progress=False))
    assert len(records) == 6 and all(r.error and not r.ok for r in records)
    assert any("busy" in r.error for r in records)


def test_a_stream_without_usage_does_not_pass_a_tpot_slo():
    """Output tokens come from `usage`: a stream without it counted 0 tokens, had no TPOT,
    and passed any TPOT SLO as if it had one token."""
    record = RequestRecord(index=0, sent=0.0, prompt_tokens=8, status=200)
    record.chunk_times, record.done = [0.1, 5.0, 9.0], 9.0
    assert record.ok and record.tpot is None
    assert not meets(record, {"tpot": 0.05}) and meets(record, {"ttft": 1.0})
    record.output_tokens = 1  # one token: no TPOT to miss
    assert meets(record, {"tpot": 0.05})


@pytest.mark.parametrize("workload", [{"workload": "mooncake"}, {"concurrency": 4}])
def test_compare_refuses_a_rate_sweep_of_a_workload_that_ignores_the_rate(tmp_path, workload):
    """A trace replays its own timestamps and a closed loop sends as answers come: a sweep
    over rates ran the same workload N times and plotted it as goodput against rate."""
    import argparse

    from pdserve.loadgen import compare

    cfg = tmp_path / "c.json"
    configurations = [{"name": "a", "rates": [1, 2], "up": []}]
    cfg.write_text(json.dumps({"workload": workload, "configurations": configurations}))
    args = argparse.Namespace(config=str(cfg), out=str(tmp_path / "out"), only=None)
    with pytest.raises(ValueError, match="ignores the rate"):
        compare.main(args)


def test_a_cluster_s_log_is_read_to_its_end_after_it_is_up(tmp_path, monkeypatch) -> None:
    """`start_cluster` read the cluster's output until "is up" and never again: every process
    of the cluster writes its log into that pipe, and once 64 KiB sat unread they blocked in
    a write (a gateway at INFO: one record per request, stuck after ~60 requests)."""
    import subprocess
    import sys

    from pdserve.loadgen import compare

    fake = tmp_path / "up.sh"  # a "cluster" that comes up, then logs 1 MB and ends
    fake.write_text("#!/bin/sh\necho 'cluster is up'\nhead -c 1000000 /dev/zero | tr '\\\\0' x\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    proc, url, _ = compare.start_cluster([], timeout=30)
    assert url.startswith("http://127.0.0.1:")
    try:
        assert proc.wait(20) == 0  # its log read: it ended
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    silent = tmp_path / "never.sh"  # a "cluster" that never comes up: stopped, with its words
    silent.write_text("#!/bin/sh\necho 'loading'\nexec sleep 600\n")
    silent.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(silent))
    with pytest.raises(RuntimeError, match="loading"):
        compare.start_cluster([], timeout=1.0)


def test_a_negative_concurrency_or_warmup_is_refused_and_a_blank_trace_line_skipped(tmp_path):
    """`--concurrency -1` started no sender (a run of nothing reported as 0 failed), and
    `--warmup -5` measured only the last 5 requests; a trace with a blank line failed to
    load ("Expecting value")."""
    import argparse

    from pdserve.loadgen.bench import add_workload_flags, build_workload

    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    args = parser.parse_args(["--num-requests", "4"])
    assert len(build_workload(args)) == 4
    for name, value in (("concurrency", -1), ("warmup", -5)):
        bad = argparse.Namespace(**{**vars(args), name: value})
        with pytest.raises(ValueError, match="0 or more"):
            build_workload(bad)
    row = {"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1]}
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(row) + "\n\n" + json.dumps(row) + "\n\n")
    assert len(workloads.mooncake(trace, 0, 10, time_scale=1.0, length_scale=1.0)) == 2
