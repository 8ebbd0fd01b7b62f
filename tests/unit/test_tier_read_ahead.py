"""The disk tier's read-ahead (common/engine/tier_reader.py): a sequence whose prefix
continues on disk waits while its blocks are read on another thread, the others scheduled
meanwhile, and loads them from memory once read; no disk read on the scheduler's thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.tiers import TierStore
from tests.unit.test_scheduler import GREEDY, _evict_a_into_the_tier, make_scheduler
from tests.unit.test_tiers import block


def _read(store: TierStore, n: int) -> bool:
    """Wait (30 s at most) until `n` blocks are read ahead. Not on the wake-up alone: one
    block read before the next is asked for empties the queue, and wakes, in between."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if store.ahead is not None and len(store.ahead.ready) >= n:
            return True
        time.sleep(0.005)
    return False


def _store(tmp_path: Path, n: int = 3) -> tuple[TierStore, threading.Event]:
    """`n` blocks written to disk, read-ahead on; the event is its wake-up."""
    store = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    for i in range(n):
        store.put(bytes([i]) * 16, block(i))
    store.writer.flush()
    woken = threading.Event()
    store.read_ahead(woken.set)
    return store, woken


def test_blocks_are_read_ahead_and_loaded_from_memory(tmp_path):
    store, woken = _store(tmp_path)
    digests = [bytes([i]) * 16 for i in range(3)]
    assert not store.ready(digests)  # asked for: read on the reader's thread
    assert woken.wait(30) and _read(store, 3) and store.ready(digests)
    for path in tmp_path.glob("*.kv"):
        path.unlink()  # read already: the load reads no file
    got: list[bytes] = []
    assert all(store.load(d, got.append) for d in digests)
    assert got == [block(i) for i in range(3)] and store.stats["disk_hits"] == 3
    assert store.ahead is not None and store.ahead.ready_bytes == 0
    store.close()


def test_a_block_dropped_while_read_ahead_is_not_kept_and_the_cap_reads_in_place(tmp_path):
    store, woken = _store(tmp_path)
    assert store.ahead is not None
    store.ahead.max_ready = 1  # full after one block: the rest are read by the caller
    assert not store.ready([b"\0" * 16])
    assert woken.wait(30)
    assert store.ready([b"\1" * 16, b"\2" * 16])  # past the cap: not waited for
    store._unlink(b"\0" * 16)  # the block left the tier: its read-ahead bytes go too
    assert store.ahead.ready_bytes == 0 and not store.ahead.ready
    store.close()


def test_a_sequence_waits_for_its_disk_prefix_while_others_are_scheduled(tmp_path):
    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=True, max_batch_tokens=64)
    tiers = TierStore(host_bytes=0, disk_bytes=10_000, disk_dir=tmp_path)
    written: dict[int, bytes] = {}
    sched.attach_tiers(tiers, lambda b: bytes([b]) * 16, written.__setitem__)
    _evict_a_into_the_tier(sched)  # a's two full blocks, on disk
    tiers.writer.flush()
    assert tiers.stats["spilled"] >= 2
    woken = threading.Event()
    tiers.read_ahead(woken.set)
    c = Sequence.new("c", [*range(1, 9), 50], GREEDY)  # a's prefix, on disk
    d = Sequence.new("d", [60, 61, 62], GREEDY)
    sched.add(c)
    sched.add(d)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.prefills] == ["d"]  # c waits for its reads
    sched.on_step_done(out, [7])
    assert woken.wait(30) and _read(tiers, 2)
    for path in tmp_path.glob("*.kv"):
        path.unlink()  # read ahead: c's load reads no file
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.prefills] == ["c"]
    assert c.num_computed_tokens == 8 and len(written) == 2  # both blocks loaded
    assert tiers.stats["corrupt"] == 0
    tiers.close()


@pytest.mark.parametrize("ahead", [False, True])
def test_without_a_node_loads_read_in_place(tmp_path, ahead):
    """No wake-up to wait for (an engine without a node's step loop): as before."""
    store = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    store.put(b"a" * 16, block(1))
    store.writer.flush()
    if ahead:
        store.read_ahead(lambda: None)
        store.ahead.max_ready = 0  # type: ignore[union-attr]
    assert store.ready([b"a" * 16]) and store.take(b"a" * 16) == block(1)
    store.close()


def test_a_queued_read_dropped_wakes_the_sequence_waiting_on_it(tmp_path):
    """The block left the tier before its read: no read ends to wake the step loop, and the
    sequence skipped for it waited for another wake-up."""
    from pdserve.common.engine.tier_reader import ReadAhead

    woken: list[int] = []
    ahead = ReadAhead(lambda: woken.append(1))
    with ahead.cond:  # queued, its thread not started yet
        ahead.jobs.queue[tmp_path / "a.kv"] = None
    ahead.drop(tmp_path / "a.kv")
    assert woken == [1] and not ahead.jobs.queue
    ahead.drop(tmp_path / "b.kv")  # nothing of it: nobody waits
    assert woken == [1]
