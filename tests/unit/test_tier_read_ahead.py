"""The disk tier's read-ahead (common/engine/tier_reader.py): a sequence whose prefix
continues on disk waits while its blocks are read on another thread, the others scheduled
meanwhile, and loads them from memory once read; no disk read on the scheduler's thread."""

from __future__ import annotations

import errno
import random
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
    store.ahead.max_ready = store.disk[b"\0" * 16]  # one block: the rest are read by the caller
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
        assert not ahead.want(tmp_path / "a.kv", "s", 10)
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


def test_the_cap_bounds_the_bytes_queued_being_read_and_read(tmp_path, monkeypatch):
    """The cap counted only the blocks read: one pass queued the disk blocks of the whole
    waiting queue (20 sequences of 3 blocks, 30 times a cap of two, held while they waited).
    Now a block counts from its queueing, the head of the queue's first."""
    prefixes = [list(range(100 * i, 100 * i + 12)) for i in range(20)]  # three blocks each
    sched, tiers, _ = _on_disk(tmp_path, *prefixes)
    ahead = tiers.ahead
    assert ahead is not None
    head = [tiers._path(d) for d in prefix_hashes(prefixes[0], 4)]
    ahead.max_ready = 2 * tiers.disk[prefix_hashes(prefixes[0], 4)[0]]  # two blocks' files
    reads = Reads(monkeypatch, hold=head[:1])  # nothing read while the pass asks
    seqs = [Sequence.new(f"s{i}", [*p, 7], GREEDY) for i, p in enumerate(prefixes)]
    for seq in seqs:
        sched.add(seq)
    sched.schedule()  # past the cap the others load in place (as many as the cache holds)
    assert reads.holding.wait(30) and len(ahead.jobs.queue) == 1  # the head's second block
    reads.go.set()
    assert _idle(tiers)
    assert ahead.ready_bytes <= ahead.max_ready and reads.paths == head[:2]
    assert ahead.reserved_bytes == ahead.max_ready
    for seq in seqs:
        sched.finish(seq, "abort")
    assert ahead.reserved_bytes == ahead.ready_bytes == 0 and not ahead.reserved
    tiers.close()


def test_a_failed_write_s_read_ahead_is_forgotten_with_it(tmp_path, monkeypatch):
    """A read made as the block's write failed (no file: None) stayed read: the block written
    anew under its name was then loaded as that None, and deleted as corrupt."""
    store = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    woken = threading.Event()
    store.read_ahead(woken.set)
    assert store.ahead is not None
    digest, path = b"a" * 16, store._path(b"a" * 16)

    def full(_: Path, __: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", full)
        store.put(digest, block(1))
        store.writer.flush()
        # `ready` looked as the write failed: on disk still, and no bytes waiting to be written
        mp.setattr(store.writer, "take_failed", lambda: [])
        assert not store.ready([digest], "s")
        assert woken.wait(30) and _read(store, 1) and store.ahead.take(path)[:2] == (True, None)
    assert store.where(digest) is None  # the failure is seen: forgotten, its read too
    store.put(digest, block(1))  # evicted again: written for good this time
    store.writer.flush()
    woken.clear()
    assert not store.ready([digest], "s")  # read anew
    assert woken.wait(30) and store.ready([digest], "s")
    got: list[bytes] = []
    assert store.load(digest, got.append) and got == [block(1)]
    assert store.stats["corrupt"] == 0 and path.exists()
    store.close()


def test_a_sequence_ending_anywhere_lets_its_reads_go(tmp_path):
    """Only a waiting sequence's reads were let go when it ended: a claim under any other's
    id (kept by a path that missed `release`) stayed for good."""
    prefix = list(range(1, 9))
    sched, tiers, _ = _on_disk(tmp_path, prefix)
    seq = Sequence.new("a", [60, 61, 62], GREEDY)
    sched.add(seq)
    assert [s.seq_id for s, _ in sched.schedule().prefills] == ["a"]  # running
    assert not tiers.ready(prefix_hashes(prefix, 4), "a")
    sched.finish(seq, "abort")
    assert tiers.ahead is not None and not tiers.ahead.asked and not tiers.ahead.owners
    assert _idle(tiers) and tiers.ahead.reserved_bytes == 0 and not tiers.ahead.ready
    tiers.close()


def test_an_exception_recording_a_read_does_not_end_the_reader():
    """Raised by `done` under the lock, it ended the thread: every read queued after it
    waited for good, and the sequences waiting on them with it."""
    from pdserve.common.engine.path_queue import PathQueue

    recorded: list[Path] = []

    def done(path: Path, _: object, __: object) -> None:
        recorded.append(path)
        if len(recorded) == 1:
            raise KeyError(path)

    jobs = PathQueue("test", lambda path, item: b"", done)
    with jobs.cond:
        jobs.put(Path("a"), None)
        jobs.put(Path("b"), None)
        assert jobs.cond.wait_for(lambda: len(recorded) == 2, timeout=30)
    jobs.close()
    assert recorded == [Path("a"), Path("b")]


def _begin(ahead: tier_reader.ReadAhead) -> Path | None:
    """The reader, driven by hand: it takes the oldest queued path and starts reading it."""
    with ahead.cond:
        if ahead.jobs.current is None and ahead.jobs.queue:
            ahead.jobs.current, _ = ahead.jobs.queue.popitem(last=False)
            return ahead.jobs.current
        return None


def _end(ahead: tier_reader.ReadAhead, data: bytes | None) -> int:
    """The read under way ends with `data`: the wake-ups it made (0 or 1)."""
    with ahead.cond:
        path, ahead.jobs.current = ahead.jobs.current, None
        after = None if path is None else ahead.jobs.done(path, None, (data, 0.0))
    if after is not None:
        after()
    return int(after is not None)


def _check_books(ahead: tier_reader.ReadAhead) -> None:
    current = {ahead.jobs.current} - {None}
    assert set(ahead.reserved) == {*ahead.jobs.queue, *current, *ahead.ready}
    assert ahead.reserved_bytes == sum(ahead.reserved.values()) <= ahead.max_ready
    assert ahead.ready_bytes == sum(len(got or b"") for got, _ in ahead.ready.values())
    assert set(ahead.ready) <= set(ahead.owners) <= set(ahead.reserved)
    assert set(ahead.asked) == set(ahead.unread)
    for owner, asked in ahead.asked.items():
        assert all(owner in ahead.owners[path] for path in asked)
        assert ahead.unread[owner] == sum(path not in ahead.ready for path in asked)
    for path, who in ahead.owners.items():
        assert who and all(path in ahead.asked[owner] for owner in who)


def test_the_read_ahead_s_books_hold_under_random_asks_releases_drops_and_reads():
    """Owners ask for, let go of and lose blocks in any order, before, while and after they
    are read (the reader stepped by hand, seeded): the bytes reserved are those of the blocks
    queued, being read or read and never pass the cap, each owner's count of blocks not read
    is right, a read of a file since dropped is never kept, the step loop is woken as an
    owner's last read ends, and once the reader is idle every block kept is a read one
    someone asked for."""
    rng = random.Random(1234)
    paths = [Path(f"/nowhere/{i}.kv") for i in range(6)]
    owners = [f"o{i}" for i in range(4)]
    for _ in range(200):
        ahead = tier_reader.ReadAhead(lambda: None, rng.choice([20, 50, 1000]))
        ahead.jobs.thread = threading.current_thread()  # no reader thread: `_begin`, `_end`
        files = dict.fromkeys(paths, 0)  # each path's file: dropped and written anew, a new one
        read = b""  # what the read under way will return: its file when it began
        for _ in range(80):
            op = rng.random()
            if op < 0.4:
                ahead.want(rng.choice(paths), rng.choice(owners), 10)
            elif op < 0.55:
                ahead.release(rng.choice(owners))
            elif op < 0.65:
                path = rng.choice(paths)
                ahead.drop(path)
                files[path] += 1
            elif op < 0.8:
                path = _begin(ahead)
                read = b"%d" % files[path] if path is not None else read
            else:  # it wakes the step loop when it is the last read one of its owners waits on
                path = ahead.jobs.current
                waits = map(ahead.unread.get, ahead.owners.get(path, ()))
                last = path is not None and path not in ahead.dropped and 1 in waits
                assert _end(ahead, rng.choice([None, read])) == last
            _check_books(ahead)
            for path, (got, _) in ahead.ready.items():
                assert got in (None, b"%d" % files[path])  # never an older file's
        while path := _begin(ahead) or ahead.jobs.current:
            _end(ahead, b"%d" % files[path])
        _check_books(ahead)
        assert set(ahead.reserved) == set(ahead.ready) == set(ahead.owners)
        assert not any(ahead.unread.values()) and not ahead.dropped
        ahead.jobs.thread = None
        ahead.close()
