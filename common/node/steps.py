"""A node's step loop: ask the scheduler for the next step, let the role prepare
(`before_step`), run the engine in the node's engine thread (so the event loop keeps answering
offers and heartbeats during a forward pass; the role's `engine_step` may add a layer hook),
and hand the result to the role (`after_step`). Preempted sequences go to `on_preempted`.

Aborts of requests the running step computes wait for that step: their blocks are in use
until it ends, and their token from it is not sent (`abort` in common/node/runtime.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from pdserve.common.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.node_metrics import NodeMetrics

# A node whose role goes on after a failed step (prefill: its batch is re-placed) stops
# after this many in a row: a lasting fault (a device error that sticks, memory that never
# frees) fails every batch at once, so the node looks idle and gets every offer while it
# fails them all; stopped, a supervisor restarts it. Above what one poison request can
# fail alone (it is re-placed at most --max-replacements, 3, times before a 503).
FAILED_IN_ROW = 8


class StepHooks(Protocol):
    """The role's part of a step."""

    async def before_step(self, out: SchedulerOutput) -> None: ...
    def engine_step(self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop) -> Any: ...
    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None: ...
    async def on_preempted(self, seqs: list[Sequence]) -> None: ...
    async def step_failed(self, out: SchedulerOutput, exc: Exception) -> None: ...


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: ThreadPoolExecutor,
        metrics: NodeMetrics,
        drop: Callable[[str], None],
        on_prefill: Callable[[int, float], None],
    ) -> None:
        self.scheduler, self.executor, self.metrics = scheduler, executor, metrics
        self.drop, self.on_prefill = drop, on_prefill  # an aborted request; a prefill's time
        self.hooks: StepHooks | None = None  # the role, plugged in once built
        self.scheduled: Callable[[str], None] = lambda rid: None  # a prefill is in a step
        self.work = asyncio.Event()  # something may be schedulable now
        self.in_step: set[str] = set()  # ids the engine is computing right now
        self.step_over: asyncio.Future[None] | None = None  # resolved when that step ends
        self.aborted: set[str] = set()  # ids to drop once the running step is over
        self.step_started: float | None = None  # when the engine's running step began
        self.failed_in_row = 0  # steps that raised since the last that did not

    def hung(self, limit: float, now: float) -> str | None:
        """Why the engine counts as hung (its step has run past `limit` seconds), or None:
        the event loop answers heartbeats and probes all the while, so only this tells."""
        if self.step_started is None or now - self.step_started <= limit:
            return None
        return f"engine step running {now - self.step_started:.0f} s (--step-timeout {limit:g})"

    def wake(self) -> None:
        self.work.set()

    def abort(self, rid: str) -> None:
        if rid in self.in_step:
            self.aborted.add(rid)
        else:
            self.drop(rid)

    async def out_of_step(self, rid: str) -> None:
        """Wait until the engine is not computing `rid` (its blocks are ours again)."""
        while rid in self.in_step and self.step_over is not None:
            await asyncio.shield(self.step_over)  # shielded: a cancelled waiter leaves it be

    async def run_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> None:
        hooks = self.hooks
        assert hooks is not None
        loop = asyncio.get_running_loop()
        while True:
            await self.work.wait()
            self.work.clear()
            while self.scheduler.has_work:
                out = self.scheduler.schedule()
                # the step's sequences are the engine's from here on: an abort while the hooks
                # below wait (a Preempted held until a gateway registers) waits for the step,
                # not frees blocks the step then computes into
                self.in_step, self.step_over = out.seq_ids, loop.create_future()
                try:
                    if out.preempted:
                        await hooks.on_preempted(out.preempted)
                    if out.empty:
                        break  # nothing fits now (KV full): wait for blocks to free
                    for seq, _ in out.prefills:  # admission took its fetched blocks itself
                        self.scheduled(seq.seq_id)
                    try:  # a hook failing fails the batch (its requests), not the node
                        await hooks.before_step(out)
                        started = self.step_started = time.monotonic()
                        result = await self.run_engine(hooks.engine_step, out, loop)
                    except Exception as exc:
                        self.metrics.step_failures.inc()
                        self.failed_in_row += 1
                        await hooks.step_failed(out, exc)
                        self._drop_aborted(self._take_aborted())
                        if self.failed_in_row >= FAILED_IN_ROW:
                            raise RuntimeError(
                                f"the engine failed {self.failed_in_row} steps in a row"
                            ) from exc
                        continue
                finally:
                    self.in_step, self.step_started = set(), None
                    self.step_over.set_result(None)
                self.failed_in_row = 0
                seconds = time.monotonic() - started
                self.metrics.step_time.observe(seconds)
                if out.prefills and not out.decodes:
                    self.on_prefill(sum(n for _, n in out.prefills), seconds)
                tokens = result[0] if isinstance(result, tuple) else result
                grew = self.scheduler.on_step_done(out, tokens)
                aborted = self._take_aborted()
                await hooks.after_step(out, [s for s in grew if s.seq_id not in aborted], result)
                self._drop_aborted(aborted)

    def _take_aborted(self) -> set[str]:
        aborted, self.aborted = self.aborted, set()
        return aborted

    def _drop_aborted(self, aborted: set[str]) -> None:
        for rid in aborted:
            self.drop(rid)
