"""The planner's bounds and search against workloads that break them: requests the cluster
refuses, simulations that come back after the last split was taken, profiles and SLOs that
nothing can serve, low rates, and budgets too large to search."""

from __future__ import annotations

import numpy as np
import pytest

import pdserve.planner.search as search
from pdserve.common.costmodel import CostModel
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.bounds import Bounds
from pdserve.planner.candidate import Candidate, Stopped
from pdserve.planner.search import Plan, evaluate, plan_splits
from pdserve.planner.sim import ClusterSim, SimConfig

PROFILE = "h100-llama3.1-8b"


def _plan_args(*argv: str):
    from pdserve.cli import build_parser

    return build_parser().parse_args(["plan", "--slo", "ttft=1000", "--no-progress", *argv])


def test_a_request_the_cluster_refuses_adds_no_work_to_the_bounds():
    """A request past the context limit ends at its arrival, never placed; its prefill, KV
    and run-alone end still went into the bounds, which fell to 0.035 req/s per node where
    the simulation served 2.77: the search could prune the best split."""
    specs = [RequestSpec(0.0, "", 20, 100), RequestSpec(0.0, "", 20, 140_000)]
    slo = {"ttft": 1.0, "tpot": 0.05}
    sim = ClusterSim(SimConfig(1, 1, PROFILE))
    info = sim.nodes["decode-0"].info
    kv = info.num_blocks * info.block_size
    cost = CostModel.named(PROFILE)
    c = evaluate(specs, SimConfig(1, 1, PROFILE), slo)
    assert c.summary["failed"] == 1  # the long one was refused
    default = Bounds.of(specs, slo, cost, info.block_size, kv)  # the model's context: 131072
    assert default.goodput_per_node(1, 1) >= c.goodput_per_node > 0
    # the search passes the limit the simulation refuses past (a node's, fit to its cache)
    limit = sim.cluster.max_model_len
    bounds = Bounds.of(specs, slo, cost, info.block_size, kv, max_model_len=limit)
    assert bounds.goodput_per_node(1, 1) >= c.goodput_per_node
    assert bounds.prefill_work[1] == bounds.kv_work[1] == 0 and not bounds.able[1]


class _StubBounds:
    """1P1D bound 10 (simulates to 6), 1P2D bound 9 (simulates to 5)."""

    least_end = 0.0
    prefill_work = np.zeros(1)

    def goodput_per_node(self, prefill: int, decode: int) -> float:
        return {(1, 1): 10.0, (1, 2): 9.0}[prefill, decode]

    def meetable(self, prefill: int) -> int:
        return 1


class _TwoWorkers:
    """A pool of two workers ending jobs in the order submitted: a job asked to beat more
    than 7 stops with a bound of 7, the others end at their true goodput per node."""

    def __init__(self, *args: object) -> None:
        self.jobs: list[tuple[SimConfig, float, float]] = []
        self.workers, self.done, self.expired = 2, 0, False

    def __enter__(self) -> _TwoWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    @property
    def full(self) -> bool:
        return len(self.jobs) >= self.workers

    def submit(self, cfg: SimConfig, bound: float, beat: tuple[float, float]) -> None:
        assert not self.full
        self.jobs.append((cfg, bound, beat[0]))

    def wait(self) -> list[Candidate | Stopped]:
        cfg, bound, ask = self.jobs.pop(0)
        self.done += 1
        if ask > 7.0:
            return [Stopped(cfg, 7.0)]
        per_node = {(1, 1): 6.0, (1, 2): 5.0}[cfg.prefill, cfg.decode]
        nodes = cfg.prefill + cfg.decode
        return [Candidate(cfg, {"goodput": per_node * nodes}, 1.0, 0, 0.0, bound=bound)]


def test_a_split_stopped_after_the_last_one_was_taken_runs_again(monkeypatch):
    """1P1D stopped (asked to beat 0.8 x 1P2D's bound) with a bound of 7, above 1P2D's 5,
    after 1P2D had been taken: it went back in the queue that no loop read again, and 1P2D
    was recommended with 1P1D counted as skipped."""
    monkeypatch.setattr(search, "Pool", _TwoWorkers)
    monkeypatch.setattr(search.Bounds, "of", lambda *a, **k: _StubBounds())
    specs = [RequestSpec(0.0, "", 4, 100)]
    plan = plan_splits(specs, {"ttft": 1.0}, 3, SimConfig(1, 1, PROFILE), max_prefill=1)
    assert [c.name for c in plan.ranked] == ["1P1D", "1P2D"]
    assert plan.skipped == 0 and plan.finished


def test_a_model_whose_weights_leave_no_kv_room_is_an_error_not_a_plan():
    """Llama-3.1-70B's weights exceed 90 % of any GPU's memory here: the cache was clamped
    to one block, every request refused, and 1P1D recommended at 0 %."""
    profile = "a100-llama3.1-70b"
    assert CostModel.named(profile).kv_capacity_tokens() == 0
    specs = [RequestSpec(0.0, "", 4, 100)]
    with pytest.raises(ValueError, match=f"{profile}.*GB of weights.*80 GB"):
        plan_splits(specs, {"ttft": 1.0}, 3, SimConfig(1, 1, profile))
    args = _plan_args("--sim-profile", profile, "--budget", "2", "--num-requests", "3")
    with pytest.raises(ValueError, match=profile):  # `pdserve plan`: an error, exit 2
        args.func(args)


def test_slos_no_request_meets_even_alone_are_an_error_not_a_plan():
    """Every bound was 0: nothing pruned, nothing stopped early, every split simulated and a
    0 % plan printed."""
    specs = [RequestSpec(0.1 * i, "", 4, 100) for i in range(5)]
    with pytest.raises(ValueError, match="even alone: ttft 1 ms"):  # 100 tokens take 9 ms
        plan_splits(specs, {"ttft": 1e-3}, 3, SimConfig(1, 1, PROFILE))
    with pytest.raises(ValueError, match="no requests"):
        plan_splits([], {"ttft": 1.0}, 3, SimConfig(1, 1, PROFILE))


def test_plan_says_no_split_meets_the_slos_when_the_best_scores_zero(monkeypatch, capsys):
    import pdserve.planner.cli as cli

    summary = {"goodput": 0.0, "ttft_ms_p50": 900.0, "ttft_ms_p99": 990.0,
               "tpot_ms_p50": 80.0, "tpot_ms_p99": 90.0}  # fmt: skip
    zero = Candidate(SimConfig(1, 1, PROFILE), summary, 0.0, 0, 0.0)
    monkeypatch.setattr(cli, "plan_splits", lambda *a, **k: Plan([zero]))
    args = _plan_args("--budget", "2", "--num-requests", "3")
    assert args.func(args) != 0
    assert "no split meets the SLOs" in capsys.readouterr().out


def test_low_rates_rank_on_unrounded_goodput():
    """The summary rounds goodput to 4 decimals: two requests 1e5 s apart scored 0 per node,
    and every split tied."""
    specs = [RequestSpec(0.0, "", 4, 100), RequestSpec(1e5, "", 4, 100)]
    slo = {"ttft": 1.0}
    small, large = (evaluate(specs, SimConfig(1, d, PROFILE), slo) for d in (1, 2))
    assert small.summary["goodput"] == 0.0  # loadgen's output is as it was
    assert isinstance(small, Candidate) and isinstance(large, Candidate)
    assert small.goodput_per_node == pytest.approx(2 / 1e5 / 2, rel=1e-4)
    assert small.key() < large.key()


def test_plan_refuses_a_budget_too_large_to_search():
    """A budget of a million nodes is 5e11 splits, each bounded before the first output."""
    from pdserve.planner.cli import _check

    _check(_plan_args("--budget", "1024"))
    with pytest.raises(ValueError, match="--budget"):
        _check(_plan_args("--budget", "1000000"))
