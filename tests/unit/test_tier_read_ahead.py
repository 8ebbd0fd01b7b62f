"""The disk tier's read-ahead (common/engine/tier_reader.py): a sequence whose prefix
continues on disk waits while its blocks are read on another thread, the others scheduled
meanwhile, and loads them from memory once read; no disk read on the scheduler's thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pdserve.common.engine import tier_reader
from pdserve.common.engine.block_manager import prefix_hashes
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.tiers import TierStore
from tests.unit.test_scheduler import GREEDY, _evict_a_into_the_tier, make_scheduler
from tests.unit.test_tiers import block


def _read(store: TierStore, n: int) -> bool:
    """Wait (30 s at most) until `n` blocks are read ahead. Not on the wake-up alone: one
    block read before the next is asked for is all its owner waits for, and wakes."""
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
    assert not store.ready(digests, "s")  # asked for: read on the reader's thread
    assert woken.wait(30) and _read(store, 3) and store.ready(digests, "s")
    for path in tmp_path.glob("*.kv"):
        path.unlink()  # read already: the load reads no file
    got: list[bytes] = []
    assert all(store.load(d, got.append) for d in digests)
    assert got == [block(i) for i in range(3)] and store.stats["disk_hits"] == 3
    store.release("s")  # loaded: the bytes read for it go
    assert store.ahead is not None and store.ahead.ready_bytes == 0
    store.close()


def test_a_block_dropped_while_read_ahead_is_not_kept_and_the_cap_reads_in_place(tmp_path):
    store, woken = _store(tmp_path)
    assert store.ahead is not None
    store.ahead.max_ready = 1  # full after one block: the rest are read by the caller
    assert not store.ready([b"\0" * 16], "s")
    assert woken.wait(30)
    assert store.ready([b"\1" * 16, b"\2" * 16], "s")  # past the cap: not waited for
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
    assert store.ready([b"a" * 16], "s") and store.take(b"a" * 16) == block(1)
    store.close()


def test_a_queued_read_dropped_wakes_the_sequence_waiting_on_it(tmp_path):
    """The block left the tier before its read: no read ends to wake the step loop, and the
    sequence skipped for it waited for another wake-up."""
    from pdserve.common.engine.tier_reader import ReadAhead

    woken: list[int] = []
    ahead = ReadAhead(lambda: woken.append(1))
    with ahead.cond:  # its thread waits for the lock: the read stays queued
        assert not ahead.want(tmp_path / "a.kv", "s")
        ahead.drop(tmp_path / "a.kv")
    assert woken == [1] and not ahead.jobs.queue
    ahead.drop(tmp_path / "b.kv")  # nothing of it: nobody waits
    assert woken == [1]
    ahead.close()


class Reads:
    """A spy on the reader's file reads: each path read, in order. A read of a path in `hold`
    waits for `go` (`holding` is set once one has begun)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: list[Path] | None = None) -> None:
        self.paths: list[Path] = []
        self.hold = hold or []
        self.holding, self.go = threading.Event(), threading.Event()
        self.real = tier_reader.read_block
        monkeypatch.setattr(tier_reader, "read_block", self.read)

    def read(self, path: Path) -> bytes | None:
        self.paths.append(path)
        if path in self.hold:
            self.holding.set()
            self.go.wait(30)
        return self.real(path)


def _on_disk(tmp_path: Path, *prefixes: list[int]) -> tuple[Scheduler, TierStore, threading.Event]:
    """A scheduler (blocks of 4 tokens) whose tiers hold the blocks of `prefixes` on disk
    alone, read-ahead on; the event is its wake-up."""
    sched = make_scheduler(num_blocks=16, block_size=4, prefix_caching=True, max_batch_tokens=64)
    tiers = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    sched.attach_tiers(tiers, lambda b: bytes([b]) * 16, lambda b, data: None)
    for tokens in prefixes:
        for digest in prefix_hashes(tokens, 4):
            tiers.put(digest, digest * 2)  # 32 bytes a block
    tiers.writer.flush()
    woken = threading.Event()
    tiers.read_ahead(woken.set)
    return sched, tiers, woken


def _idle(tiers: TierStore) -> bool:
    """Wait (30 s at most) until the reader has no read queued or under way."""
    ahead = tiers.ahead
    assert ahead is not None
    with ahead.cond:
        done = lambda: not ahead.jobs.queue and ahead.jobs.current is None  # noqa: E731
        return ahead.cond.wait_for(done, timeout=30)


def test_a_burst_sharing_a_disk_prefix_reads_it_once_and_is_served_at_once(tmp_path, monkeypatch):
    """Sequences over one prefix on disk, asking while its blocks are read: the first to load
    them took the bytes, the next asked for them again (read twice, a step later)."""
    shared = list(range(1, 9))  # two blocks
    sched, tiers, woken = _on_disk(tmp_path, shared)
    paths = [tiers._path(d) for d in prefix_hashes(shared, 4)]
    reads = Reads(monkeypatch, hold=paths[:1])
    a, b, c = (Sequence.new(s, [*shared, 50 + i], GREEDY) for i, s in enumerate("abc"))
    sched.add(a)
    assert sched.schedule().empty  # a waits for its reads
    assert reads.holding.wait(30)  # the first block being read, the second queued
    sched.add(b)
    sched.add(c)
    assert sched.schedule().empty
    reads.go.set()
    assert woken.wait(30) and _idle(tiers)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.prefills] == ["a", "b", "c"]
    assert a.num_computed_tokens == b.num_computed_tokens == c.num_computed_tokens == 8
    assert reads.paths == paths  # each block read once
    assert tiers.ahead is not None and tiers.ahead.ready_bytes == 0  # all loaded: let go
    tiers.close()


def test_a_short_disk_prefix_is_woken_for_before_a_long_one_is_read(tmp_path, monkeypatch):
    """One wake-up came for a whole run of reads: a prefix of one block waited for the
    blocks of the long prefix queued behind it."""
    short, long = list(range(1, 5)), list(range(100, 112))  # one block; three
    sched, tiers, woken = _on_disk(tmp_path, short, long)
    reads = Reads(monkeypatch, hold=[tiers._path(prefix_hashes(long, 4)[0])])
    first = Sequence.new("s", [*short, 50], GREEDY)
    second = Sequence.new("l", [*long, 51], GREEDY)
    sched.add(first)
    sched.add(second)
    assert sched.schedule().empty  # both wait for their reads
    assert reads.holding.wait(30)  # s's block read (its wake-up came first), l's under way
    assert woken.is_set()
    woken.clear()
    out = sched.schedule()
    assert [x.seq_id for x, _ in out.prefills] == ["s"] and first.num_computed_tokens == 4
    sched.on_step_done(out, [7])
    reads.go.set()
    assert woken.wait(30)  # l's last block read
    out = sched.schedule()
    assert [x.seq_id for x, _ in out.prefills] == ["l"] and second.num_computed_tokens == 12
    assert len(reads.paths) == 4
    tiers.close()


def test_blocks_read_ahead_for_sequences_that_ended_are_let_go_at_once(tmp_path, monkeypatch):
    """Aborted while their blocks were read: what was read stayed, for nobody, 30 s or until
    256 MiB were read ahead; what was queued was read still. Shared, it stays for the
    sequence still waiting."""
    prefix = list(range(1, 13))  # three blocks
    sched, tiers, _ = _on_disk(tmp_path, prefix)
    paths = [tiers._path(d) for d in prefix_hashes(prefix, 4)]
    reads = Reads(monkeypatch, hold=paths[1:2])
    a, b = (Sequence.new(s, [*prefix, 50 + i], GREEDY) for i, s in enumerate("ab"))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().empty
    assert reads.holding.wait(30)  # the first block read, the second under way, one queued
    assert tiers.ahead is not None and tiers.ahead.ready_bytes == 32
    sched.finish(a, "abort")
    assert tiers.ahead.ready_bytes == 32  # b's still
    sched.finish(b, "abort")
    assert tiers.ahead.ready_bytes == 0 and not tiers.ahead.ready
    reads.go.set()
    assert _idle(tiers)
    assert tiers.ahead.ready_bytes == 0 and reads.paths == paths[:2]  # none kept; 3rd not read
    tiers.close()
