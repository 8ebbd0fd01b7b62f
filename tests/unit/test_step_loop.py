"""The node's step loop (common/node/steps.py): a request aborted while the role prepares a
step (`before_step`, `on_preempted`: either may wait, e.g. for a gateway to register) is
dropped after the step that computes it, never before: dropped first, its blocks would be
free while the engine writes its token's KV into them."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.steps import FAILED_IN_ROW, StepLoop
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.sampling import SamplingParams


class _Hooks:
    def __init__(self, events: list[str]) -> None:
        self.events, self.go, self.preparing = events, asyncio.Event(), asyncio.Event()

    async def before_step(self, out) -> None:
        self.preparing.set()
        await self.go.wait()  # the role waits here (a gateway to register, a send)

    def engine_step(self, out, loop) -> list[int]:
        self.events.append("step " + ",".join(sorted(out.seq_ids)))
        return [7] * (len(out.prefills) + len(out.decodes))

    async def after_step(self, out, grew, result) -> None:
        self.events.append("after " + ",".join(sorted(s.seq_id for s in grew)))

    async def on_preempted(self, seqs) -> None: ...

    async def step_failed(self, out, exc) -> None: ...


async def test_an_abort_while_a_step_is_prepared_waits_for_that_step():
    cfg = SchedulerConfig(max_num_seqs=8, max_batch_tokens=64, chunk_size=0, num_blocks=16,
                          block_size=4)  # fmt: skip
    scheduler, events = Scheduler(cfg), list[str]()
    hooks = _Hooks(events)
    seq = Sequence.new("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    scheduler.add(seq)

    def drop(rid: str) -> None:
        events.append(f"drop {rid} holding {len(seq.block_table)} blocks")
        scheduler.finish(seq, "abort")

    metrics = NodeMetrics("n", "colocated", lambda: None, 16)  # type: ignore[arg-type,return-value]
    with ThreadPoolExecutor(1) as pool:
        loop = StepLoop(scheduler, pool, metrics, drop, lambda tokens, seconds: None)
        loop.hooks = hooks  # type: ignore[assignment]
        task = asyncio.create_task(loop.run())
        loop.wake()
        await asyncio.wait_for(hooks.preparing.wait(), 10)  # scheduled; the role prepares
        loop.abort("a")  # e.g. its client left
        assert events == []  # not dropped yet: the step will compute into its blocks
        hooks.go.set()
        for _ in range(1000):
            if any(e.startswith("drop") for e in events):
                break
            await asyncio.sleep(0.01)
        task.cancel()
    assert events == ["step a", "after ", "drop a holding 1 blocks"]


class _Failing(_Hooks):
    """Steps raise but for the ones named in `ok`; a failed batch is dropped, as a prefill
    node's (its requests re-placed) is."""

    def __init__(self, scheduler: Scheduler, ok: set[str]) -> None:
        super().__init__([])
        self.go.set()
        self.scheduler, self.ok = scheduler, ok

    def engine_step(self, out, loop) -> list[int]:
        if not set(out.seq_ids) & self.ok:
            raise RuntimeError("device error")
        return super().engine_step(out, loop)

    async def step_failed(self, out, exc) -> None:
        for seq, _ in out.prefills:
            self.scheduler.finish(seq, "abort")

    async def after_step(self, out, grew, result) -> None:
        for seq, _ in out.prefills:  # one token each: done
            self.scheduler.finish(seq, "length")


async def _run_steps(ok: set[str], n: int) -> tuple[BaseException | None, float]:
    """n one-token prompts, one a step: how the loop ended (None: still running once every
    step ran) and the failures counted on /metrics."""
    cfg = SchedulerConfig(max_num_seqs=1, max_batch_tokens=64, chunk_size=0, num_blocks=64,
                          block_size=4)  # fmt: skip
    scheduler = Scheduler(cfg)
    for i in range(n):
        scheduler.add(Sequence.new(f"r{i:02}", [1, 2], SamplingParams(max_tokens=1)))
    metrics = NodeMetrics("n", "prefill", lambda: None, 64)  # type: ignore[arg-type,return-value]
    with ThreadPoolExecutor(1) as pool:
        loop = StepLoop(scheduler, pool, metrics, lambda rid: None, lambda t, s: None)
        loop.hooks = _Failing(scheduler, ok)  # type: ignore[assignment]
        task = asyncio.create_task(loop.run())
        loop.wake()
        for _ in range(1000):
            if task.done() or not scheduler.has_work:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        ended = task.exception() if task.done() else None
        task.cancel()
    return ended, metrics.step_failures._value.get()


async def test_a_node_whose_engine_fails_every_step_stops():
    """A prefill node goes on after a failed step (its batch re-placed); one whose engine
    fails every step (a device error that sticks) looked idle and healthy, took every offer
    and failed each until the requests ran out of re-placements. It stops after
    FAILED_IN_ROW in a row, for its supervisor to restart it."""
    ended, failures = await _run_steps(set(), FAILED_IN_ROW)
    assert isinstance(ended, RuntimeError) and "in a row" in str(ended), ended
    assert failures == FAILED_IN_ROW


async def test_a_step_that_runs_resets_the_count_of_failures():
    ok = {f"r{FAILED_IN_ROW - 1:02}"}  # fails 7, runs one, fails 7 more: never 8 in a row
    ended, failures = await _run_steps(ok, 2 * FAILED_IN_ROW - 1)
    assert ended is None
    assert failures == 2 * FAILED_IN_ROW - 2
