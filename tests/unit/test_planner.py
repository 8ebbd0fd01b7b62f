"""The planner's cluster simulation (planner/sim.py) against cases with known answers: one
request alone (the cost model's step times, summed), and a prefill node serving one prompt
at a time under Poisson arrivals (M/D/1: the Pollaczek-Khinchine mean wait)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.common.costmodel import CostModel
from pdserve.loadgen.metrics import meets
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.bounds import Bounds
from pdserve.planner.candidate import Stopped, missed
from pdserve.planner.search import evaluate, plan_splits
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
    ranked = plan_splits(specs, slo, 6, SimConfig(1, 1, PROFILE, prefix_caching=False)).ranked
    best = ranked[0].cfg
    assert best.prefill > best.decode, [c.row() for c in ranked[:4]]
    assert ranked[0].attainment >= 0.9
    # the search stopped at the size that served (nearly) everything: no 6-node split tried
    assert max(c.nodes for c in ranked) < 6


def _conversations(n: int, rate: float, seed: int = 0) -> list[RequestSpec]:
    """Multi-turn sessions: each turn's prompt is the previous turn's plus new tokens (the
    prefix caches hit), outputs of varied length."""
    rng = np.random.default_rng(seed)
    specs: list[RequestSpec] = []
    t = 0.0
    while len(specs) < n:
        t += rng.exponential(1 / rate)
        context = rng.integers(1000, 40000, int(rng.integers(500, 3000))).tolist()
        at = t
        for _ in range(int(rng.integers(1, 4))):
            out = int(rng.integers(2, 300))
            specs.append(RequestSpec(at, list(context), out, len(context)))
            context += rng.integers(1000, 40000, int(rng.integers(50, 400))).tolist()
            at += rng.exponential(2.0)
    specs.sort(key=lambda s: s.arrival)
    return specs[:n]


@pytest.mark.parametrize(
    "cfg",
    [
        SimConfig(2, 2, PROFILE),
        SimConfig(1, 1, PROFILE, num_kv_blocks=1500),  # decode preempts, requests re-placed
        SimConfig(3, 1, PROFILE, policy="round_robin", admission="fifo", prefill_max_batch=2),
        SimConfig(1, 3, PROFILE, decode_placement="best_fit", prefix_caching=False),
        SimConfig(2, 2, PROFILE, chunk_size=512, step_overhead_s=0.002),
    ],
)
def test_decode_runs_give_the_same_tokens_and_times_as_stepping(cfg):
    specs = _conversations(150, rate=12.0)
    stepped, fast = ClusterSim(dataclasses.replace(cfg, decode_runs=False)), ClusterSim(cfg)
    a, b = stepped.run(specs), fast.run(specs)
    assert [r.chunk_times for r in a] == [r.chunk_times for r in b]  # every token, exactly
    assert [(r.done, r.output_tokens) for r in a] == [(r.done, r.output_tokens) for r in b]
    assert stepped.replacements == fast.replacements
    # runs were taken (how many steps a run stands for depends on how often KV arrives at
    # its node: the gain at scale is benchmarks/planner.py's)
    assert fast.events_done < stepped.events_done
    if cfg.num_kv_blocks:
        assert fast.replacements > 0  # the preempting path was exercised


def test_a_decode_run_is_the_cost_models_steps_summed():
    cost = CostModel.named(PROFILE)
    rng = np.random.default_rng(1)
    for _ in range(200):
        contexts = rng.integers(1, 100_000, int(rng.integers(1, 300))).tolist()
        exact = cost.decode_step_seconds(contexts)
        assert cost.decode_batch_seconds(len(contexts), sum(contexts)) == exact  # same float


def test_the_cost_model_bound_is_never_below_a_simulated_split():
    specs = _conversations(300, rate=20.0, seed=2)
    slo = {"ttft": 0.5, "tpot": 0.03}
    cost = CostModel.named(PROFILE)
    sim = ClusterSim(SimConfig(1, 1, PROFILE))
    info = sim.nodes["decode-0"].info
    bounds = Bounds.of(specs, slo, cost, info.block_size, info.num_blocks * info.block_size)
    for p, d in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (4, 4)]:
        c = evaluate(specs, SimConfig(p, d, PROFILE), slo)
        assert bounds.goodput_per_node(p, d) >= c.goodput_per_node, (p, d)


def test_the_search_skips_what_cannot_win_and_retries_only_binding_limits():
    cost = CostModel.named(PROFILE)
    prompt = 4000
    rate = 2.5 / cost.prefill_seconds(prompt)
    rng = np.random.default_rng(5)
    specs = _specs(np.cumsum(rng.exponential(1 / rate, 300)), prompt, 20)
    slo = {"ttft": 4 * cost.prefill_seconds(prompt), "tpot": 0.05}
    base = SimConfig(1, 1, PROFILE, prefix_caching=False)
    serial = plan_splits(specs, slo, 8, base, (64,))
    assert serial.skipped > 0 and serial.finished
    # 4,000-token prompts and an 8,192-token batch budget: two prompts per batch at most,
    # so a limit of 32 or 64 sequences never binds and is not simulated again
    assert any("never bound" in note for note in serial.notes)
    assert all(c.cfg.prefill_max_batch == 32 for c in serial.ranked)
    parallel = plan_splits(specs, slo, 8, base, (64,), workers=2)
    assert parallel.ranked[0].row() == serial.ranked[0].row()  # each simulation is exact


def test_max_seconds_answers_with_the_best_found_so_far():
    specs = _conversations(300, rate=20.0, seed=3)
    plan = plan_splits(specs, {"ttft": 0.5}, 16, SimConfig(1, 1, PROFILE), max_seconds=1e-3)
    assert not plan.finished


def test_a_simulation_stops_early_only_when_its_lost_requests_bound_it_below_the_ask():
    specs = _conversations(400, rate=40.0, seed=4)  # far more than one prefill node serves
    slo = {"ttft": 0.5, "tpot": 0.03}
    cost = CostModel.named(PROFILE)
    info = ClusterSim(SimConfig(1, 1, PROFILE)).nodes["decode-0"].info
    bounds = Bounds.of(specs, slo, cost, info.block_size, info.num_blocks * info.block_size)
    cfg = SimConfig(1, 1, PROFILE)
    full = evaluate(specs, cfg, slo)
    ask = 2 * full.goodput_per_node
    stopped = evaluate(specs, cfg, slo, beat=(ask, bounds.least_end), work=bounds.prefill_work)
    assert isinstance(stopped, Stopped)
    # what it said it could still reach is below the ask and above what it does reach
    assert full.goodput_per_node <= stopped.bound < ask


def test_one_token_requests_have_no_tpot_to_miss_while_their_kv_lands(monkeypatch):
    """A request of one output token has no TPOT (meets() passes it), but while its KV was in
    transfer it was counted as a TPOT miss: a simulation could stop itself with a bound below
    what it reaches, and the split be cut from the search. Nothing missed mid-run may exceed
    what the finished run missed."""
    import pdserve.planner.sim as sim_module

    monkeypatch.setattr(sim_module, "PROGRESS_MIN", 1)  # watch every event
    monkeypatch.setattr(sim_module, "PROGRESS_EVERY", 1)
    specs = [RequestSpec(i * 0.05, "", 1, 32000 if i % 2 else 100) for i in range(20)]
    slo = {"ttft": 60.0, "tpot": 0.02}  # shorter than a 32k prompt's KV transfer
    seen: list[int] = []
    sim = ClusterSim(SimConfig(1, 1, PROFILE, prefix_caching=False))
    records = sim.run(specs, lambda s: seen.append(missed(s, slo)))
    assert len(seen) > len(specs)
    assert max(seen) <= sum(not meets(r, slo) for r in records) == 0


def test_retried_batch_limits_wait_for_a_free_worker():
    """Retrying the best splits at other batch limits submitted them all at once: with every
    worker busy, Pool.submit raised (min() of no free slot) and the search was lost."""
    specs = [RequestSpec(i * 0.0005, "", 4, 100) for i in range(200)]
    plan = plan_splits(specs, {"ttft": 5.0}, 3, SimConfig(1, 1, PROFILE), (8, 16), workers=1)
    assert plan.finished and plan.ranked
    assert 16 in {c.cfg.prefill_max_batch for c in plan.ranked}  # a retry ran


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--rate", "nan"], "--rate"),  # NaN arrival times: the search never finished
        (["--rate", "-2"], "--rate"),  # quietly "all at once"
        (["--num-requests", "0"], "--num-requests"),
        (["--slo", "ttft=nan"], "bad SLO"),  # every split scored 0, a recommendation printed
        (["--slo", "ttft=-5"], "bad SLO"),
        (["--max-prefill", "0"], "--max-prefill"),  # ignored: every split tried
        (["--max-seconds", "0"], "--max-seconds"),  # meant no limit
        (["--budget", "1"], "--budget"),
        (["--try-max-batch", "0"], "--try-max-batch"),
    ],
)
def test_plan_refuses_what_would_plan_nothing(argv, match):
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["plan", "--slo", "ttft=1000", "--no-progress", *argv])
    with pytest.raises(ValueError, match=match):
        args.func(args)


def test_text_prompts_share_cached_blocks_only_as_far_as_their_texts_agree():
    """A text prompt (sharegpt) was simulated as one token id repeated: every prompt a
    prefix-cache hit of every earlier one, prefill nearly free from the second on."""
    a, b = "the quick brown fox " * 800, ("lorem ipsum dolor sit amet " * 600)[:16000]
    texts = [a, b, a[:2000] + b[:14000]]  # the third begins as the first, for 500 tokens
    specs = [RequestSpec(10.0 * i, t, 4, len(t) // 4) for i, t in enumerate(texts)]
    records = ClusterSim(SimConfig(1, 1, PROFILE)).run(specs)
    [distinct] = ClusterSim(SimConfig(1, 1, PROFILE)).run(_specs([0.0], 4000, 4))
    assert records[0].ttft == pytest.approx(distinct.ttft, rel=1e-9)
    assert records[1].ttft == pytest.approx(records[0].ttft, rel=1e-9)  # nothing shared
    assert records[1].ttft > records[2].ttft > 0.8 * records[1].ttft  # ~500 tokens cached


def test_a_request_the_gateway_would_refuse_fails_and_the_bounds_agree():
    """Returned as completed with done=0 (ok, meeting every SLO): a workload past the
    model's context was planned as servable, and one past what a decode node's cache holds
    (the limit a real node reports) stalled there and counted as good."""
    from pdserve.loadgen.metrics import summarize

    cost = CostModel.named(PROFILE)
    long = RequestSpec(0.0, [1000] * 100, cost.model.max_context, 100)
    sim = ClusterSim(SimConfig(1, 1, PROFILE))
    [refused] = sim.run([long])
    assert not refused.ok and "context" in refused.error
    assert missed(sim, {"ttft": 1.0}) == 1  # refused at t=0: done is 0, yet it has ended
    past_cache = RequestSpec(0.0, list(range(1000, 1060)), 100, 60)  # 160 tokens, 8 blocks
    [rec] = ClusterSim(SimConfig(1, 1, PROFILE, num_kv_blocks=8)).run([past_cache])
    assert not rec.ok and "context" in rec.error and not meets(rec, {"ttft": 1.0})
    assert summarize([rec], {"ttft": 1.0})["goodput"] == 0
    assert not Bounds.of([long], {"ttft": 60.0}, cost, 16, 10**6).able.any()
    able = [Bounds.of([past_cache], {"ttft": 60.0}, cost, 16, kv).able[0] for kv in (128, 10**6)]
    assert able == [False, True]  # a decode node's cache bounds the context too


def test_equal_goodputs_rank_by_the_split_not_by_which_simulation_ended_first():
    """Goodput is rounded, and exact ties happen (2P2D and 1P2D at 4.6874 on one workload);
    with several workers the candidates arrive in completion order and a stable sort kept
    it: the recommended split depended on the race."""
    from pdserve.planner.candidate import Candidate

    def made(p: int, d: int, batch: int) -> Candidate:
        cfg = SimConfig(p, d, PROFILE, prefill_max_batch=batch)
        return Candidate(cfg, {"goodput": 4.6874 * (p + d)}, 1.0, 0, 0.0)

    both = [made(2, 1, 16), made(1, 2, 16), made(1, 2, 8)]
    first = sorted(both, key=Candidate.key)
    assert [(c.name, c.cfg.prefill_max_batch) for c in first] == [
        ("1P2D", 8), ("1P2D", 16), ("2P1D", 16)]  # fmt: skip
    assert sorted(reversed(both), key=Candidate.key) == first


def test_a_one_token_request_ends_at_its_first_token_as_on_a_prefill_node():
    """A prefill node hands no KV off for a request of one token: it ends there. The
    simulation ended it when a KV transfer it never makes would have landed."""
    [rec] = ClusterSim(SimConfig(1, 1, PROFILE)).run(_specs([0.0], 8000, 1))
    assert rec.ok and rec.output_tokens == 1 and rec.e2e == rec.ttft


def test_plan_takes_bench_s_warmup_and_plans_the_requests_bench_measures():
    """`bench --warmup W` draws the workload for N + W requests (the warm-ups are its first
    W, so every measured request differs from a run without warm-ups) and measures all but
    the first W: `plan` had no --warmup, and planned another mix."""
    import argparse

    from pdserve.loadgen.bench import add_workload_flags, build_workload
    from pdserve.planner.cli import measured

    p = argparse.ArgumentParser()
    add_workload_flags(p)
    p.add_argument("--warmup", type=int, default=0)
    argv = ["--num-requests", "6", "--rate", "2", "--input-len", "lognormal:1024:1.0"]
    bench = build_workload(p.parse_args([*argv, "--warmup", "4"]))[4:]  # what bench measures
    plan = measured(build_workload(p.parse_args([*argv, "--warmup", "4"])), 4)
    assert [s.prompt for s in plan] == [s.prompt for s in bench]
    assert plan[0].arrival == 0.0 and [s.arrival for s in plan] == pytest.approx(
        [s.arrival - bench[0].arrival for s in bench])  # fmt: skip
    cold = build_workload(p.parse_args(argv))
    assert [s.prompt_len for s in cold] != [s.prompt_len for s in plan]  # why it matters


def test_deadline_order_serves_first_the_requests_that_can_still_meet_the_ttft_slo():
    """The simulation's requests had no deadline (the gateway's is arrival + --ttft-slo):
    `plan --admission deadline` simulated FIFO. Overloaded, FIFO makes every request late;
    deadline order serves those that can still make it."""
    cost = CostModel.named(PROFILE)
    service = cost.prefill_seconds(2000)
    specs = _specs(np.arange(60) * service / 1.5, 2000, 1)  # 1.5x what one node serves
    slo = 3 * service
    met = {}
    for admission in ("fifo", "deadline"):
        cfg = SimConfig(1, 1, PROFILE, prefill_max_batch=1, admission=admission,
                        prefix_caching=False, ttft_slo=slo)  # fmt: skip
        sim = ClusterSim(cfg)
        met[admission] = sum(r.ttft <= slo for r in sim.run(specs))
        assert [r.entry.deadline for r in sim.arrived.values()] == pytest.approx(
            [s.arrival + slo for s in specs])  # fmt: skip
    assert met["deadline"] > 3 * met["fifo"], met


def test_plan_gives_the_simulated_gateway_the_slo_s_ttft_as_its_deadline(monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.planner import cli

    real, seen = cli.plan_splits, []

    def plan_splits(specs, slo, budget, base, *args, **kwargs):
        seen.append(base)  # the configuration every split is simulated with
        return real(specs, slo, budget, base, *args, **kwargs)

    monkeypatch.setattr(cli, "plan_splits", plan_splits)
    argv = ["plan", "--slo", "ttft=800,tpot=50", "--admission", "deadline", "--budget", "2",
            "--num-requests", "8", "--input-len", "500", "--output-len", "4", "--rate", "4",
            "--no-progress", "--workers", "1", "--try-max-batch", ""]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    assert [(c.admission, c.ttft_slo) for c in seen] == [("deadline", pytest.approx(0.8))]


def test_an_urgent_request_no_node_takes_keeps_one_free_until_it_fits():
    """The gateway keeps a node free for a request that waited --admission-max-wait and
    found no room (gateway/placement.py `_reserve`); the simulation passed it over, so
    short prompts arriving once a pass kept a long one out until they stopped (10 s)."""
    cost = CostModel.named(PROFILE)
    gap = 0.8 * cost.prefill_seconds(1500)  # a short prompt joins every pass
    shorts = _specs(np.arange(int(10 / gap)) * gap, 1500, 1)
    [long] = _specs([gap / 2], 3000, 1, seed=1)  # fits only a node with nothing else
    cfg = SimConfig(1, 1, PROFILE, max_batch_tokens=4096, admission="fifo", prefix_caching=False)
    records = ClusterSim(cfg).run(sorted([*shorts, long], key=lambda s: s.arrival))
    [waited] = [r.ttft for r in records if r.prompt_tokens == 3000]
    assert cfg.admission_max_wait < waited < cfg.admission_max_wait + 0.5
    assert all(r.ok for r in records)
