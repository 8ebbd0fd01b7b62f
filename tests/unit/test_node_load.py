"""A node's load report (common/node/runtime.py `load`): the room it offers is what its
scheduler would allocate, free and cached blocks short of the watermark."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.runtime import NodeRuntime
from pdserve.common.sampling import SamplingParams
from tests.unit.test_scheduler import make_scheduler, run_step


def test_the_room_reported_is_the_room_an_allocation_has():
    """100 blocks, a watermark of 10, 85 in use, 10 cached, 5 free: 5 can be allocated.
    Gateways add free and cached blocks up as a node's room; the cached ones were offered
    whole (10), so KV placed there was refused and redirected."""
    sched = make_scheduler(num_blocks=100, block_size=4, prefix_caching=True,
                           watermark_blocks=10, max_batch_tokens=64)  # fmt: skip
    seq = Sequence.new("a", list(range(1, 42)), SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(seq)
    run_step(sched)
    sched.finish(seq, "length")  # 10 full blocks cached, 1 free
    bm = sched.block_manager
    bm.allocate(85)
    assert (bm.num_in_use_blocks, bm.num_cached_blocks, bm.num_free_blocks) == (85, 10, 15)
    node = SimpleNamespace(
        scheduler=sched, blocks=bm, requests={}, kv=None, token_cost=0.0,
        role=SimpleNamespace(extra_held=list, promised_blocks=int),
        control=SimpleNamespace(draining=False),
    )  # fmt: skip
    load = NodeRuntime.load(node)  # type: ignore[arg-type]
    assert load.blocks_free + load.blocks_cached == bm.num_free_blocks - 10 == 5
    assert load.blocks_free == 5  # an allocation takes the uncached ones first
    assert load.blocks_in_use == 85
