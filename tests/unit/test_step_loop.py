"""The node's step loop (common/node/steps.py): a request aborted while the role prepares a
step (`before_step`, `on_preempted`: either may wait, e.g. for a gateway to register) is
dropped after the step that computes it, never before: dropped first, its blocks would be
free while the engine writes its token's KV into them."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.steps import StepLoop
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
