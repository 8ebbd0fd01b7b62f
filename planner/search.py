"""The P:D planner: the split of a node budget between prefill and decode that serves a
workload best, by simulation (planner/sim.py).

Objective: goodput per node (requests meeting every SLO per second, the load generator's
definition but unrounded, divided by the nodes used), then total goodput, then fewer nodes.
A budget is a ceiling, not a target: for the workload as given (its arrival rate included),
the planner right-sizes, and a split that serves everything within SLO on fewer nodes beats
a larger one.

Branch and bound: every split within the budget (and the per-role ceilings) gets an upper
bound on its goodput per node from the cost model (planner/bounds.py), and splits are
simulated best bound first, one process per core. A simulation also bounds itself as it
goes (the requests it has already lost, candidate.py `missed`): it stops once that bound
falls below the best split simulated (the split is dropped) or well below the next split's
bound (it goes back in the queue with its new bound, and when that is the highest left
runs again, then until it cannot beat the best). A large workload's first split is the one
its first eighth's plan recommends, run to its end, so that the others have a best to beat
from the start. The search ends when no bound left beats the best split and no simulation
runs (one that stops after the last split was taken may put its split back). The best few
are then tried with other prefill batch limits (`--max-batch`, the on-demand accept rule's
`bp`) unless the limit never bound: a limit above the largest batch a prefill node ever
held changes nothing. A workload no split can serve (no request fits a node, or none meets
the SLOs even alone) is a ValueError, not a 0 % plan.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.common.costmodel import CostModel
from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.bounds import Bounds
from pdserve.planner.candidate import Candidate, Stopped, evaluate
from pdserve.planner.decode_run import prompt_tokens
from pdserve.planner.pool import Pool
from pdserve.planner.sim import ClusterSim, SimConfig

__all__ = ["Candidate", "Plan", "evaluate", "plan_splits", "splits"]

REFINE = 3  # splits tried with the other prefill batch limits
TIE = 1e-6  # goodput per node is compared rounded to this (Candidate.key)
DEFER = 0.8  # a simulation is put back once its bound falls below this x the next one's
SEED_AT = 2000  # from this many requests, a plan of the first eighth picks the first split


@dataclass
class Plan:
    ranked: list[Candidate]  # every split simulated, best first
    skipped: int = 0  # splits whose bound could not beat the best
    cut: int = 0  # simulations stopped once their misses showed they could not beat it
    notes: list[str] = field(default_factory=list)
    finished: bool = True  # False: --max-seconds ran out (the best found so far)


def splits(
    budget: int, max_prefill: int | None = None, max_decode: int | None = None
) -> Iterator[tuple[int, int]]:
    """Every xPyD with x + y <= budget within the per-role ceilings."""
    if budget < 2:
        raise ValueError("a node budget of at least 2 (one prefill, one decode) is needed")
    for n in range(2, budget + 1):
        for x in range(1, n):
            if x <= (max_prefill or n) and n - x <= (max_decode or n):
                yield x, n - x


def plan_splits(
    specs: list[RequestSpec],
    slo: dict[str, float],
    budget: int,
    base: SimConfig,
    batches: tuple[int, ...] = (),
    *,
    max_prefill: int | None = None,
    max_decode: int | None = None,
    workers: int = 1,
    max_seconds: float | None = None,
    progress: Callable[[Pool, Candidate | None], None] | None = None,
) -> Plan:
    """The splits simulated, best first (see the module's note for the order and the cut).
    ValueError when no split can serve a request within the SLOs (nothing to rank)."""
    deadline = time.monotonic() + max_seconds if max_seconds else None  # the seed's time too
    cost = CostModel.named(base.profile)
    probe = ClusterSim(dataclasses.replace(base, prefill=1, decode=1))
    node = probe.nodes["decode-0"].info
    limit = probe.cluster.max_model_len  # the context limit the simulation refuses past
    _check_workload(specs, base, cost, limit)
    kv_tokens = node.num_blocks * node.block_size
    bounds = Bounds.of(specs, slo, cost, node.block_size, kv_tokens, base.step_overhead_s, limit)
    pairs = list(splits(budget, max_prefill, max_decode))
    _check_meetable(bounds, slo, max(x for x, _ in pairs))
    # (bound, x, y): best bound first; a split stopped early comes back with the (lower)
    # bound its lost requests left it
    todo = [(bounds.goodput_per_node(x, y), x, y) for x, y in pairs]
    todo.sort(key=_order)
    seed = _seed(specs, slo, budget, base, max_prefill, max_decode, workers, max_seconds)
    if seed is not None:  # first, and run to its end: the best to beat from then on
        at = next(i for i, t in enumerate(todo) if t[1:] == seed)
        todo.insert(0, todo.pop(at))
    deferred: set[tuple[int, int]] = set()
    plan = Plan([])
    with Pool(specs, slo, workers, deadline, bounds.prefill_work.tolist()) as pool:

        def best() -> float:
            return max((c.goodput_per_node for c in plan.ranked), default=-1.0)

        def collect() -> None:
            for c in pool.wait():
                if isinstance(c, Stopped):
                    if c.bound < best() - TIE:
                        plan.cut += 1
                    else:  # behind the splits whose bounds are higher now
                        item = (c.bound, c.cfg.prefill, c.cfg.decode)
                        bisect.insort(todo, item, key=_order)
                        deferred.add(item[1:])
                    continue
                plan.ranked.append(c)
                if progress is not None:
                    progress(pool, c)

        def start() -> None:
            nonlocal seed
            bound, x, y = todo.pop(0)
            # stop it once it cannot beat the best, or falls well below the next split's
            # bound (it comes back when that is the highest left: each time >= 1/DEFER lower)
            ask = max(best() - TIE, DEFER * todo[0][0] if todo else -1.0)
            if (x, y) in deferred:  # put back once already: it runs until it cannot win
                ask = best() - TIE
            if (x, y) == seed:
                ask, seed = -1.0, None
            cfg = dataclasses.replace(base, prefill=x, decode=y)
            pool.submit(cfg, bound, (ask, bounds.least_end))
            if progress is not None:
                progress(pool, None)

        # one loop until nothing runs: a simulation ending after the last split was taken
        # may put its split back (stopped, its bound still >= the best), to run again
        while (todo or pool.busy) and not pool.expired:
            if todo and todo[0][0] >= best() - TIE and not pool.full:
                start()
            elif pool.busy:
                collect()
            else:
                break  # no split left can beat the best one simulated
        plan.skipped = len(todo)
        plan.ranked.sort(key=Candidate.key)
        same: dict[str, list[int]] = {}  # split -> limits not simulated (never bound)
        for c in plan.ranked[:REFINE]:
            for b in batches:
                if b == c.cfg.prefill_max_batch or pool.expired:
                    continue
                if c.peak_batch < min(b, c.cfg.prefill_max_batch):
                    same.setdefault(f"{c.name} (held <= {c.peak_batch})", []).append(b)
                    continue
                while pool.full and not pool.expired:  # every worker busy: take one's end
                    collect()
                if pool.expired:
                    break
                retry = dataclasses.replace(c.cfg, prefill_max_batch=b)
                pool.submit(retry, c.bound, (best() - TIE, bounds.least_end))
        if same:
            plan.notes.append(
                f"the prefill batch limit never bound in {', '.join(same)}: the prefill nodes "
                f"never held as many sequences as --max-batch {base.prefill_max_batch} or "
                f"{', '.join(str(b) for b in sorted({b for v in same.values() for b in v}))} "
                "allow, so those limits give the same results and were not simulated"
            )
        while pool.busy and not pool.expired:
            collect()
        plan.finished = not pool.expired
    plan.ranked.sort(key=Candidate.key)
    return plan


def _check_workload(specs: list[RequestSpec], base: SimConfig, cost: CostModel, limit: int) -> None:
    """An empty workload, or one whose every request the cluster refuses (past its context
    limit: a model whose weights leave no KV room refuses all), has nothing to plan."""
    if not specs:
        raise ValueError("the workload has no requests to plan for (are all of them warm-ups?)")
    need = min(len(prompt_tokens(s.prompt, s.prompt_len)) + s.max_tokens for s in specs)
    if need <= limit:
        return
    m, g = cost.model, cost.gpu
    cache = (
        f"{base.num_kv_blocks} KV blocks (num_kv_blocks)"
        if base.num_kv_blocks
        else f"{m.name}'s {m.weight_bytes / 1e9:.1f} GB of weights in 90 % of the {g.name}'s "
        f"{g.hbm_bytes / 1e9:.0f} GB leave KV room for {cost.kv_capacity_tokens()} tokens"
    )
    raise ValueError(
        f"sim profile {base.profile!r}: no request fits a node (the shortest needs {need} "
        f"tokens, prompt + max_tokens; a node takes {limit}): {cache} (the model's context: "
        f"{m.max_context})"
    )


def _check_meetable(bounds: Bounds, slo: dict[str, float], prefill: int) -> None:
    """Every split would score 0 (and none could be pruned): an error, not a 0 % plan."""
    if bounds.meetable(prefill) > 0:
        return
    asked = ", ".join(f"{k} {v * 1000:g} ms" for k, v in slo.items())
    least = ", ".join(f"{k} {bounds.fastest[k] * 1000:.4g} ms" for k in slo if k in bounds.fastest)
    raise ValueError(
        f"no request can meet the SLOs even alone: {asked} asked, and the least any request "
        f"takes alone (the cost model's) is {least}"
    )


def _order(item: tuple[float, int, int]) -> tuple[float, int, int]:
    bound, x, y = item
    return (-bound, x + y, x)


def _seed(
    specs: list[RequestSpec],
    slo: dict[str, float],
    budget: int,
    base: SimConfig,
    max_prefill: int | None,
    max_decode: int | None,
    workers: int,
    max_seconds: float | None,
) -> tuple[int, int] | None:
    """For a large workload: the best split for its first eighth (planned the same way), a
    guess at the best for the whole. Simulated first, it gives the others a goodput per node
    to beat at once, so the overloaded splits the loose bounds rank first stop early."""
    if len(specs) < SEED_AT:
        return None
    part = sorted(specs, key=lambda s: s.arrival)[: len(specs) // 8]
    try:
        quick = plan_splits(
            part,
            slo,
            budget,
            base,
            max_prefill=max_prefill,
            max_decode=max_decode,
            workers=workers,
            max_seconds=max_seconds / 4 if max_seconds else None,
        )
    except ValueError:  # nothing in the first eighth can meet the SLOs: no guess, no error
        return None
    if not quick.ranked:
        return None
    return quick.ranked[0].cfg.prefill, quick.ranked[0].cfg.decode
