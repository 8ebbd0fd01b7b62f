"""What a benchmark is given and what it reports from it: one seed's prompts at every rate,
a comparison's workload keys, and the gateway study's ratios to its one-gateway row."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.loadgen import compare, workloads

LOGNORMAL = workloads.LengthDist.parse("lognormal:64:0.5")
UNIFORM = workloads.LengthDist.parse("uniform:16:8")


def _what(specs: list[workloads.RequestSpec]) -> list[tuple]:
    return [(s.prompt, s.max_tokens, s.prompt_len) for s in specs]


@pytest.mark.parametrize("seed", [0, 5])
def test_one_seed_sends_the_same_prompts_at_every_rate_and_burstiness(tmp_path, seed):
    """Arrivals, lengths and tokens came from one generator: a closed loop (rate 0, no
    arrivals drawn) or another burstiness (gamma draws of another count) shifted every later
    draw, so a comparison across rates measured different prompts."""
    runs = [(0.0, 1.0), (4.0, 1.0), (4.0, 0.5), (20.0, 2.0)]
    synthetic = [_what(workloads.synthetic(seed, 30, r, k, LOGNORMAL, UNIFORM)) for r, k in runs]
    assert all(s == synthetic[0] for s in synthetic)
    shared = [_what(workloads.shared_prefix(seed, 30, r, k, 3, 32, 8, 4)) for r, k in runs]
    assert all(s == shared[0] for s in shared)
    path = tmp_path / "sharegpt.json"
    turns = [[{"value": f"prompt {i}"}, {"value": "r" * (8 * i + 8)}] for i in range(10)]
    path.write_text(json.dumps([{"conversations": t} for t in turns]))
    picked = [_what(workloads.sharegpt(path, seed, 30, r, k)) for r, k in runs]
    assert all(s == picked[0] for s in picked)
    other = seed + 1  # and another seed is another workload
    assert _what(workloads.synthetic(other, 30, 0.0, 1.0, LOGNORMAL, UNIFORM)) != synthetic[0]
    assert _what(workloads.shared_prefix(other, 30, 0.0, 1.0, 3, 32, 8, 4)) != shared[0]
    assert _what(workloads.sharegpt(path, other, 30, 0.0, 1.0)) != picked[0]


def _compare(tmp_path, workload: dict) -> argparse.Namespace:
    cfg = tmp_path / "c.json"
    configurations = [{"name": "a", "rates": [2], "up": ["--prefill", "1"]}]
    cfg.write_text(json.dumps({"workload": workload, "configurations": configurations}))
    return argparse.Namespace(config=str(cfg), out=str(tmp_path / "out"), only=None,
                              startup_timeout=1.0)  # fmt: skip


def test_compare_refuses_a_workload_key_it_does_not_know(tmp_path):
    """A misspelt `num_request` was dropped: the run measured the default 40 requests."""
    with pytest.raises(ValueError, match=r"\['num_request'\].*known: .*'num_requests'"):
        compare.load_config(Path(_compare(tmp_path, {"num_request": 8}).config))
    with pytest.raises(ValueError, match=r"\['rate'\].*rates go in each configuration"):
        compare.load_config(Path(_compare(tmp_path, {"rate": 8}).config))


def test_compare_sends_as_its_workload_says(tmp_path, monkeypatch):
    """endpoint, stagger, model, fresh_connections and no_ignore_eos were never passed on:
    every comparison ran the completions endpoint with bench's defaults."""
    seen: list = []

    async def fake_run(specs, cfg):
        seen.append((specs, cfg))
        return []

    monkeypatch.setattr(compare, "start_cluster", lambda up, t: (None, "http://gw", ["a"] * 3))
    monkeypatch.setattr(compare, "stop_cluster", lambda proc: None)
    monkeypatch.setattr(compare, "gateway_counts", lambda url: {})
    monkeypatch.setattr(compare, "plot", lambda *a: None)
    monkeypatch.setattr(compare, "run", fake_run)
    workload = {"num_requests": 3, "concurrency": 2, "model": "m", "endpoint": "chat",
                "stagger": 0.25, "fresh_connections": True, "no_ignore_eos": True}  # fmt: skip
    assert compare.main(_compare(tmp_path, workload)) == 0
    [(specs, cfg)] = seen
    assert (cfg.url, cfg.model, cfg.endpoint, cfg.stagger) == ("http://gw", "m", "chat", 0.25)
    assert cfg.fresh_connections and not cfg.ignore_eos and cfg.concurrency == 2
    assert len(specs) == 3 and all(isinstance(s.prompt, str) for s in specs)  # chat: text
    with pytest.raises(ValueError, match="endpoint"):
        compare.load_config(Path(_compare(tmp_path, {"endpoint": "chats"}).config))
    # --only: a run recorded before these keys were known ran them at their defaults
    (tmp_path / "old").mkdir()
    old = {"workload": "synthetic", "num_requests": 3}
    (tmp_path / "old" / compare.INPUTS).write_text(json.dumps({"workload": old, "up": {}}))
    (tmp_path / "old" / "summary.json").write_text("[]")
    data = {"configurations": [{"name": "a", "up": [], "rates": [2]}]}
    now = {**old, **{k: compare.WORKLOAD_DEFAULTS[k] for k in ("model", "endpoint", "stagger")}}
    assert compare.earlier(tmp_path / "old", data, {"a"}, now) == {}


def test_the_gateway_study_writes_no_ratio_to_a_zero(tmp_path, monkeypatch):
    """The one-gateway row's hit rate, goodput or CPU net of idle can be 0 (no prefix hit,
    no request within the SLOs, idle CPU above the run's): ZeroDivisionError after every
    measurement had run, and scaling.json was never written."""
    from benchmarks import gateways

    keys = ("prefix_hit_rate", "goodput", "gateway_cpu_s_per_request",
            "gateway_cpu_s_per_request_net_of_idle")  # fmt: skip
    measured = {1: dict.fromkeys(keys, 0.0) | {"gateway_cpu_s_per_request": 0.02},
                2: dict.fromkeys(keys, 0.5)}  # fmt: skip
    monkeypatch.setattr(gateways.workloads, "mooncake", lambda *a: [])
    monkeypatch.setattr(gateways, "_measure", lambda n, specs: dict(measured[n]))
    one, two = gateways.scaling(tmp_path, [1, 2], 10)
    assert json.loads((tmp_path / "scaling.json").read_text()) == [one, two]
    assert (two["hit_rate_vs_one"], two["goodput_vs_one"]) == (None, None)
    assert two["cpu_per_request_vs_one"] == 25.0 and one["cpu_per_request_vs_one"] == 1.0
    assert two["cpu_per_request_net_of_idle_vs_one"] is None
    assert two["cpu_per_request_vs_one_same_load"] == 25.0  # the one-gateway run at 1/2 rate
    assert two["cpu_per_request_net_of_idle_vs_one_same_load"] is None
