"""Simulations of several splits at once: one process per core, each a whole `ClusterSim`
run (they share nothing but the workload, inherited when the process forks). With one
worker they run in this process. Each reports how far it got (the share of its requests
done) for the planner's progress line, and all stop when the deadline passes.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from typing import Any

from pdserve.loadgen.workloads import RequestSpec
from pdserve.planner.candidate import Candidate, Stopped, evaluate
from pdserve.planner.sim import SimConfig

POLL_S = 0.2

_WORK: dict[str, Any] = {}  # in a worker: the workload and the shared progress slots


class _Expired(Exception):
    """The deadline passed mid-simulation (one worker: raised from its progress hook)."""


@dataclass(eq=False)
class Job:
    cfg: SimConfig
    bound: float
    slot: int
    beat: tuple[float, float]  # (best goodput per node when it started, least duration)
    result: AsyncResult[Candidate | Stopped] | None = None

    @property
    def name(self) -> str:
        return f"{self.cfg.prefill}P{self.cfg.decode}D"


class Pool:
    def __init__(
        self,
        specs: list[RequestSpec],
        slo: dict[str, float],
        workers: int,
        deadline: float | None,
        work: Sequence[float] = (),
    ) -> None:
        self.workers = max(1, workers)
        self.deadline = deadline
        self.jobs: list[Job] = []
        self.done = 0
        self._timed_out = False
        self._specs, self._slo, self._work = specs, slo, work
        self._shares = mp.get_context().Array("d", self.workers, lock=False)
        self._pool = None
        if self.workers > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            self._pool = ctx.Pool(
                self.workers, _init, (specs, slo, work, self._shares), maxtasksperchild=None
            )

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.terminate()  # the deadline may leave simulations running: not waited
            self._pool.join()

    # -- state --------------------------------------------------------------------------------
    @property
    def expired(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self._timed_out = True
        return self._timed_out

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    @property
    def full(self) -> bool:
        return len(self.jobs) >= self.workers

    def running(self) -> list[tuple[str, float]]:
        """Each simulation in flight: its split and the share of its requests done."""
        return [(j.name, self._shares[j.slot]) for j in self.jobs]

    # -- work ---------------------------------------------------------------------------------
    def submit(self, cfg: SimConfig, bound: float, beat: tuple[float, float]) -> None:
        used = {j.slot for j in self.jobs}
        slot = min(s for s in range(self.workers) if s not in used)
        self._shares[slot] = 0.0
        job = Job(cfg, bound, slot, beat)
        if self._pool is not None:
            job.result = self._pool.apply_async(_run, (cfg, slot, beat))
        self.jobs.append(job)

    def wait(self) -> list[Candidate | Stopped]:
        """Candidates of the simulations that ended (at least one, unless time ran out)."""
        if self._pool is None:
            return self._run_here()
        while not self.expired:
            ended = [j for j in self.jobs if j.result is not None and j.result.ready()]
            if ended:
                for j in ended:
                    self.jobs.remove(j)
                return [self._ended(j, j.result.get()) for j in ended if j.result]
            time.sleep(POLL_S)
        return []

    def _run_here(self) -> list[Candidate | Stopped]:
        job = self.jobs[0]

        def report(share: float) -> None:
            self._shares[job.slot] = share
            if self.expired:
                raise _Expired

        try:
            c = evaluate(self._specs, job.cfg, self._slo, report, job.beat, self._work)
        except _Expired:
            return []
        finally:
            self.jobs.remove(job)
        return [self._ended(job, c)]

    def _ended(self, job: Job, c: Candidate | Stopped) -> Candidate | Stopped:
        self.done += 1
        if isinstance(c, Candidate):
            c.bound = job.bound
        return c


def _init(
    specs: list[RequestSpec], slo: dict[str, float], work: Sequence[float], shares: Any
) -> None:
    _WORK.update(specs=specs, slo=slo, work=work, shares=shares)


def _run(cfg: SimConfig, slot: int, beat: tuple[float, float]) -> Candidate | Stopped:
    shares = _WORK["shares"]

    def report(share: float) -> None:
        shares[slot] = share

    hook: Callable[[float], None] = report
    return evaluate(_WORK["specs"], cfg, _WORK["slo"], hook, beat, _WORK["work"])
