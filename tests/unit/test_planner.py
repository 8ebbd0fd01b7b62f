"""The planner's cluster simulation (planner/sim.py) against cases with known answers: one
request alone (the cost model's step times, summed), and a prefill node serving one prompt
at a time under Poisson arrivals (M/D/1: the Pollaczek-Khinchine mean wait)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.common.costmodel import CostModel
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.search import plan_splits
from pdserve.planner.sim import ClusterSim, SimConfig

PROFILE = "h100-llama3.1-8b"


def _specs(times, prompt: int, out: int, seed: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)  # distinct prompts: nothing is prefix-cached
    return [
        RequestSpec(float(t), rng.integers(1000, 40000, prompt).tolist(), out, prompt)
        for t in times
    ]


def test_one_request_alone_takes_exactly_the_cost_models_step_times():
    cost = CostModel.named(PROFILE)
    prompt, out = 1000, 20
    [rec] = ClusterSim(SimConfig(1, 1, PROFILE)).run(_specs([0.0], prompt, out))
    ttft = cost.prefill_seconds(prompt)
    ready = ttft + cost.transfer_seconds(prompt)  # the KV is on the decode node
    steps = [cost.decode_step_seconds([prompt + j]) for j in range(1, out)]
    assert rec.ttft == pytest.approx(ttft, rel=1e-12)
    assert rec.e2e == pytest.approx(ready + sum(steps), rel=1e-12)
    assert rec.output_tokens == out and len(rec.chunk_times) == out
    assert np.allclose(np.diff(rec.chunk_times[1:]), steps[1:])  # each later token: one step


def test_requests_arriving_slower_than_service_never_wait():
    cost = CostModel.named(PROFILE)
    gap = 2 * cost.prefill_seconds(2000)
    records = ClusterSim(SimConfig(1, 1, PROFILE)).run(_specs(np.arange(50) * gap, 2000, 1))
    assert [r.ttft for r in records] == pytest.approx([cost.prefill_seconds(2000)] * 50)


def test_one_prompt_at_a_time_under_poisson_arrivals_waits_as_m_d_1():
    cost = CostModel.named(PROFILE)
    prompt, rho, n = 2000, 0.7, 6000
    service = cost.prefill_seconds(prompt)
    rng = np.random.default_rng(3)
    times = np.cumsum(rng.exponential(service / rho, n))
    cfg = SimConfig(1, 1, PROFILE, prefill_max_batch=1, admission="fifo", prefix_caching=False)
    records = ClusterSim(cfg).run(_specs(times, prompt, 1))
    waits = np.array([r.ttft for r in records]) - service
    # each wait is Lindley's recursion on these arrivals, exactly
    lindley = np.zeros(n)
    for k in range(1, n):
        lindley[k] = max(0.0, lindley[k - 1] + service - (times[k] - times[k - 1]))
    assert np.allclose(waits, lindley, atol=1e-9)
    # and their mean the Pollaczek-Khinchine formula's, within this sample's noise
    # (the seeds 0-3 give 0.97-1.13 of it at this size)
    expected = rho * service / (2 * (1 - rho))
    assert waits[n // 10 :].mean() == pytest.approx(expected, rel=0.2)


def test_the_planner_right_sizes_and_gives_prefill_heavy_load_more_prefill_nodes():
    cost = CostModel.named(PROFILE)
    prompt = 4000
    rate = 2.5 / cost.prefill_seconds(prompt)  # needs about three prefill nodes
    rng = np.random.default_rng(5)
    specs = _specs(np.cumsum(rng.exponential(1 / rate, 300)), prompt, 20)
    slo = {"ttft": 4 * cost.prefill_seconds(prompt), "tpot": 0.05}
    ranked = plan_splits(specs, slo, 6, SimConfig(1, 1, PROFILE, prefix_caching=False))
    best = ranked[0].cfg
    assert best.prefill > best.decode, [c.row() for c in ranked[:4]]
    assert ranked[0].attainment >= 0.9
    # the search stopped at the size that served (nearly) everything: no 6-node split tried
    assert max(c.nodes for c in ranked) < 6
