"""The shm backend's segments over their whole life: an aborted transfer's segment is never
lent to another while the decode node may still read it, segments are allocated whole (a
full /dev/shm sends by zmq instead of SIGBUS), a crashed node's segments are swept, a node's
id cannot make its live segments look like another kind of file, and the decode side lets
go of destroyed segments' mappings without waiting for a new name."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from pdserve.common.kv import shm
from pdserve.common.kv.shm import SHM_DIR, SegmentPool
from pdserve.common.ofd import sweep_dead_kv_files
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import TO_DECODE_DECODER, KvLayer
from pdserve.common.wire.transport import decode_or_none
from tests.component.cluster import until
from tests.component.test_kv_backends import Pair, digest


def _hold_layers(pair: Pair) -> asyncio.Event:
    """The decode node falls behind: it reads no KvLayer until the event is set (headers,
    KvDone and the rest queue behind the first layer, in order)."""
    gate, handle = asyncio.Event(), pair.intake.handle

    async def held(parts):
        if isinstance(decode_or_none(TO_DECODE_DECODER, parts[1].bytes), KvLayer):
            await gate.wait()
        await handle(parts)

    pair.intake.handle = held  # type: ignore[method-assign]
    return gate


async def test_an_aborted_transfer_s_segment_is_never_lent_while_the_decode_node_reads_it(
    monkeypatch,
):
    """The prefill node sent every KvLayer and the KvDone of `a`, then its client left: the
    abort gave the segment back at once, `b` (the same size) was lent it and wrote its layers
    there, and the decode node, behind, copied b's bytes as a's, admitted a on its KvDone and
    cached them under a's prompt (the Abort behind it found nothing)."""
    monkeypatch.setattr(shm, "PRUNE_S", 0.05, raising=False)  # the decode side prunes meanwhile
    pair = await Pair("shm", 600).start()
    gate = _hold_layers(pair)
    try:
        n, tables = 40, {"a": [0, 1, 2], "b": [10, 11, 12]}
        ta = pair.sender.begin("a", pair.target, list(range(n)), n, SamplingParams(), tables["a"])
        pair.sender.push_all(ta, pair.sender.stage_all(ta))
        pair.sender.done(ta, 1)
        await until(lambda: "a" in pair.intake.incoming, 5.0, "a's header read")
        await until(lambda: pair.sender.peers["d"].outbox.empty(), 5.0, "a's KvDone sent")
        segment = ta.state
        pair.sender.abort("a")  # the client left before the KvAck
        tb = pair.sender.begin("b", pair.target, list(range(n)), n, SamplingParams(), tables["b"])
        assert tb.backend == "shm"
        pair.sender.push_all(tb, pair.sender.stage_all(tb))
        pair.sender.done(tb, 1)
        await asyncio.sleep(0.3)  # a's segment is gone from /dev/shm, still read here
        gate.set()
        admitted = [await asyncio.wait_for(pair.admitted.get(), 10)]
        if admitted[0].header.request_id == "a":
            admitted.append(await asyncio.wait_for(pair.admitted.get(), 10))
        for intake in admitted:  # whatever was admitted holds its own KV
            rid = intake.header.request_id
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, tables[rid], n)
        await until(lambda: not pair.intake.incoming, 5.0, "every transfer over")
        maps = pair.receivers["shm"].maps  # type: ignore[attr-defined]
        await until(lambda: segment.name not in maps.maps, 5.0, "a's mapping let go")
    finally:
        await pair.close()


def test_segments_are_allocated_whole_when_made():
    """ftruncate alone made a sparse file: a /dev/shm too small for the pages touched later
    (Docker's 64 MiB, a burst) killed the prefill node with SIGBUS in export_into."""
    pool = SegmentPool("test-whole")
    try:
        seg = pool.take(3 << 20)
        st = os.stat(os.path.join(SHM_DIR, seg.name))
        assert st.st_size == seg.size == 4 << 20 and st.st_blocks * 512 >= seg.size
    finally:
        pool.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(pool.prefix)]


async def test_a_full_dev_shm_sends_by_zmq_instead(monkeypatch):
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    pair = await Pair("shm", 600).start()
    try:
        landed = await pair.send("r", 40, [0, 1, 2], layerwise=True)
        assert landed.header.backend == "zmq"
        assert digest(pair.dst, landed.block_table, 40) == digest(pair.src, [0, 1, 2], 40)
        pool = pair.sender.connector("shm").pool  # type: ignore[attr-defined]
        assert not pool.all and not [
            n for n in os.listdir(SHM_DIR) if n.startswith(pool.prefix + "-") and n[-1].isdigit()
        ]  # the segment that found no room is not left behind
    finally:
        await pair.close()


def test_a_killed_node_s_segments_are_swept_and_a_live_one_s_kept():
    """Segments had no owner lock and a name no sweep covered: every crash of a prefill node
    left its segments in /dev/shm until a reboot."""
    live = SegmentPool("test-live")
    seg = live.take(1 << 20)  # (a pool's first segment sweeps: made before the crash)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a prefill node: makes segments, says where, dies without closing its pool
        try:
            dead = SegmentPool("test-dead")
            names = [dead.take(1 << 20).name for _ in range(2)]
            os.write(write, " ".join([dead.prefix, *names]).encode())
        finally:
            os.kill(os.getpid(), 9)
    os.close(write)
    prefix, *names = os.read(read, 4096).decode().split()
    os.waitpid(pid, 0)
    os.close(read)
    paths = [os.path.join(SHM_DIR, n) for n in names]
    try:
        assert all(os.path.exists(p) for p in paths)
        assert sweep_dead_kv_files() >= len(paths)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]  # its owner file too
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))
    finally:
        live.close()
        for n in os.listdir(SHM_DIR):
            if n.startswith(prefix):
                os.unlink(os.path.join(SHM_DIR, n))


@pytest.mark.parametrize("node_id", ["kv-1", "grants-a"])
def test_a_node_id_cannot_make_live_segments_look_like_dead_cache_or_grant_files(node_id):
    """Segments were named pdserve-NODE-...: a node `kv-1` made pdserve-kv-1-..., which any
    node's start swept as a dead KV cache file (nobody locks it) while it was being read."""
    pool = SegmentPool(node_id)
    try:
        seg = pool.take(1 << 20)
        sweep_dead_kv_files()
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))
    finally:
        pool.close()


async def test_the_decode_side_lets_go_of_destroyed_segments_with_no_new_name(monkeypatch):
    """After a burst the sender's pool destroys what it keeps no more and lends the rest;
    the decode side let go of a destroyed segment's mapping only when a new name came, so it
    held the unlinked files' memory in /dev/shm for as long as none did."""
    monkeypatch.setattr(shm, "PRUNE_S", 0.05, raising=False)
    pair = await Pair("shm", 600).start()
    try:
        first = await pair.send("r0", 40, [0, 1, 2], layerwise=True)
        pair.release(first.block_table)
        pool = pair.sender.connector("shm").pool  # type: ignore[attr-defined]
        maps = pair.receivers["shm"].maps  # type: ignore[attr-defined]
        (seg,) = pool.free
        assert seg.name in maps.maps
        pool.max_free = 0
        pool.give_back(pool.free.pop())  # one free too many: destroyed
        await until(lambda: seg.name not in maps.maps, 5.0, "the mapping let go")
    finally:
        await pair.close()


def test_a_segment_whose_view_outlives_its_stage_is_destroyed_without_raising():
    """A failed stage's traceback holds a view into its segment while the step's failure
    drops the request: closing the mapping then raised BufferError out of the step loop,
    which stopped the node. It is unlinked now, and unmapped with its last view."""
    pool = SegmentPool("test-held")
    try:
        seg = pool.take(1 << 20)
        held = seg.view(0, 16)
        pool.destroy(seg)  # no BufferError
        assert not os.path.exists(os.path.join(SHM_DIR, seg.name)) and seg not in pool.all
        held.release()
        seg.mem.close()  # nothing holds it now
    finally:
        pool.close()
