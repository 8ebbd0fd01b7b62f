"""UCX frames matched to their descriptors (common/kv/ucx.py): a dropped transfer's frames
drained for as long as its sender sends, and a frame nobody asks for left alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.common.kv.ucx import available as ucx_available
from pdserve.common.sampling import SamplingParams
from tests.component.cluster import until
from tests.component.test_kv_backends import LAYOUT, Pair, digest

pytestmark = pytest.mark.skipif(
    not ucx_available(), reason="ucxx is not installed (pip install '.[ucx]')"
)


async def test_a_dropped_ucx_transfer_drains_its_frames_however_long_its_sender_runs():
    """UCX frames follow their descriptors on the endpoint: a transfer dropped on
    the decode side (its client left) still has each frame taken off the endpoint as its
    descriptor comes, for as long as its sender keeps sending. The placeholder was forgotten
    3 x timeout after its header: a longer layer-wise pass then left its later frames on the
    endpoint, and the next transfer from that peer read them into its blocks."""
    pair = await Pair("ucx", capacity=600).start()
    pair.intake.timeout = 0.2  # the placeholder's old life: 0.6 s from its header
    try:
        n, table = 40, [0, 1, 2]
        t = pair.sender.begin("long", pair.target, list(range(n)), n, SamplingParams(), table)
        pair.sender.push(t, 0, pair.sender.stage(t, 0))
        incoming = pair.intake.incoming
        await until(lambda: "long" in incoming and incoming["long"].layers == {0}, 5.0, "landed")
        assert pair.intake.drop("long")  # the client left: the decode side lets go
        placeholder = pair.intake.incoming["long"]
        for layer in range(1, LAYOUT.num_layers):  # a pass of 29 x 0.1 s: 5 x the old life
            drained = placeholder.progress
            pair.sender.push(t, layer, pair.sender.stage(t, layer))
            await until(lambda d=drained: placeholder.progress > d, 5.0, f"layer {layer} drained")
            await asyncio.sleep(0.1)
            await pair.intake.expire(time.monotonic())
            assert "long" in pair.intake.incoming
        pair.sender.done(t, 1)
        await until(lambda: "long" not in pair.intake.incoming, 5.0, "forgotten at its KvDone")
        pair.sender.release("long")
        ok = await pair.send("next", n, [5, 6, 7], layerwise=True)
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, [5, 6, 7], n)
    finally:
        await pair.close()


async def test_a_ucx_frame_nobody_receives_does_not_shift_the_next_transfer():
    """A frame on the endpoint that no descriptor asks for (its transfer forgotten here, or
    its descriptor lost) is left alone: each receive matches its own frame's tag. Matched by
    order, the next transfer from that peer read it into its first layer's blocks."""
    pair = await Pair("ucx", capacity=600).start()
    try:
        n, table = 40, [0, 1, 2]
        ghost = pair.sender.begin("ghost", pair.target, list(range(n)), n, SamplingParams(),
                                  [9, 10, 11])  # fmt: skip
        connector = pair.sender.connector("ucx")
        stray = asyncio.create_task(connector.send(ghost, 0, pair.sender.stage(ghost, 0)))
        await asyncio.sleep(0.2)  # on its way (an eager send completes; a large one waits)
        pair.sender.release("ghost")
        ok = await pair.send("next", n, table, layerwise=True)
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, table, n)
        stray.cancel()
    finally:
        await pair.close()
