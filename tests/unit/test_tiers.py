"""The prefix cache's lower tiers: host pool, spill to disk, LRU caps, checksums, and the
load-or-recompute decision from measured costs."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from pdserve.common.engine.tiers import TierStore


def block(i: int, size: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(size))


def test_blocks_spill_from_host_to_disk_and_come_back_byte_exact(tmp_path):
    store = TierStore(host_bytes=2500, disk_bytes=10_000, disk_dir=tmp_path)
    for i in range(5):
        store.put(bytes([i]) * 16, block(i))
    assert [store.where(bytes([i]) * 16) for i in range(5)] == ["disk"] * 3 + ["host"] * 2
    for i in range(5):
        assert store.take(bytes([i]) * 16) == block(i)
    assert store.stats["disk_hits"] == 3 and store.stats["host_hits"] == 2


def test_both_tiers_are_capped_least_recently_used_first(tmp_path):
    store = TierStore(host_bytes=1000, disk_bytes=2100, disk_dir=tmp_path)  # 1 + 2 blocks
    for i in range(5):
        store.put(bytes([i]) * 16, block(i))
    assert [store.where(bytes([i]) * 16) for i in range(5)] == [None, None, "disk", "disk", "host"]
    store.writer.flush()
    assert len(os.listdir(tmp_path)) == 2 and store.disk_used <= 2100
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_block_evicted_again_is_as_recently_used_as_a_take(tmp_path):
    """A block loaded back from the host pool is evicted from the engine again: its `put`
    found it there and returned without refreshing it, so it went first to make room."""
    store = TierStore(host_bytes=2000)  # two blocks
    store.put(b"a" * 16, block(1))
    store.put(b"b" * 16, block(2))
    store.put(b"a" * 16, block(1))  # again: now the most recent
    store.put(b"c" * 16, block(3))
    assert [store.where(d * 16) for d in (b"a", b"b", b"c")] == ["host", None, "host"]


def test_a_corrupt_disk_block_is_a_miss_and_is_dropped(tmp_path):
    store = TierStore(host_bytes=0, disk_bytes=10_000, disk_dir=tmp_path)
    store.put(b"a" * 16, block(1))
    store.writer.flush()
    (path,) = tmp_path.iterdir()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.take(b"a" * 16) is None
    assert store.where(b"a" * 16) is None and store.stats["corrupt"] == 1
    assert list(tmp_path.iterdir()) == []


def test_a_disk_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """The disk fills mid-write: the block is not spilled, and its partial file is removed
    (it sat outside the tier's budget until the node's next start)."""
    store = TierStore(host_bytes=0, disk_bytes=10_000, disk_dir=tmp_path)
    real = Path.write_bytes

    def full(path: Path, data: bytes) -> int:
        real(path, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    store.put(b"a" * 16, block(1))
    store.writer.flush()
    assert store.where(b"a" * 16) is None and store.disk_used == 0
    assert list(tmp_path.glob("*.tmp")) == []


def test_spills_are_written_off_the_caller_s_thread_and_served_until_written(tmp_path):
    """The scheduler evicting blocks runs on a node's event loop: a spill must not hold it
    for a file write. Held here behind a write that cannot end, the caller goes on; the
    waiting block is served from its bytes, and one dropped before its write never lands."""
    store = TierStore(host_bytes=0, disk_bytes=3100, disk_dir=tmp_path)  # three blocks
    gate = threading.Event()
    real = Path.write_bytes

    def slow(path: Path, data: bytes) -> int:
        gate.wait(30)
        return real(path, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", slow)
        started = time.monotonic()
        for i in range(4):  # the fourth pushes the first out: two waiting, one writing
            store.put(bytes([i]) * 16, block(i))
        assert time.monotonic() - started < 5  # not one write waited for
        assert store.take(bytes([3]) * 16) == block(3)  # not on disk yet: from memory
        assert store.where(bytes([0]) * 16) is None
        gate.set()
        store.writer.flush()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(bytes([i]).hex() * 16 + ".kv" for i in (1, 2, 3))
    for i in (1, 2, 3):
        assert store.take(bytes([i]) * 16) == block(i)  # now read back from its file
    assert store.stats["disk_hits"] == 4 and store.stats["corrupt"] == 0
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_block_dropped_while_it_is_written_leaves_no_file(tmp_path):
    store = TierStore(host_bytes=0, disk_bytes=1100, disk_dir=tmp_path)  # one block
    writing, gate = threading.Event(), threading.Event()
    real = Path.write_bytes

    def slow(path: Path, data: bytes) -> int:
        writing.set()
        gate.wait(30)
        return real(path, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", slow)
        store.put(b"a" * 16, block(1))
        assert writing.wait(30)
        store.put(b"b" * 16, block(2))  # pushes "a" out while its write runs
        gate.set()
        store.writer.flush()
    assert [p.name for p in tmp_path.iterdir()] == [b"b".hex() * 16 + ".kv"]
    assert store.take(b"b" * 16) == block(2) and store.where(b"a" * 16) is None


def test_spills_past_the_pending_cap_are_dropped_and_a_failing_writer_goes_on(tmp_path):
    """A disk slower than the evictions held every spill in memory, up to the disk tier's
    size (hundreds of GB); and an exception out of one write (not an OSError) ended the
    writer thread, after which nothing was written again."""
    store = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    store.writer.max_pending = 3500  # three blocks, the one being written among them
    gate, calls = threading.Event(), []
    real = Path.write_bytes

    def flaky(path: Path, data: bytes) -> int:
        calls.append(path)
        gate.wait(30)
        if len(calls) == 1:
            raise MemoryError("the first write")
        return real(path, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", flaky)
        for i in range(5):  # one being written, two waiting, two past the cap
            store.put(bytes([i]) * 16, block(i))
            while i == 0 and not calls:
                time.sleep(0.01)
        assert store.stats["dropped"] == 2
        assert [store.where(bytes([i]) * 16) for i in range(5)] == ["disk"] * 3 + [None] * 2
        gate.set()
        store.writer.flush()
    assert store.where(b"\0" * 16) is None  # its write failed: forgotten
    assert store.take(b"\1" * 16) == block(1) and store.take(b"\2" * 16) == block(2)
    store.put(b"\7" * 16, block(7))  # the writer still writes
    store.writer.flush()
    assert (tmp_path / (b"\7".hex() * 16 + ".kv")).exists()
    assert store.disk_used == sum(p.stat().st_size for p in tmp_path.glob("*.kv"))


def test_a_block_still_waiting_to_be_written_does_not_teach_the_disk_s_cost(tmp_path):
    store = TierStore(host_bytes=0, disk_bytes=100_000, disk_dir=tmp_path)
    gate = threading.Event()
    real = Path.write_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", lambda p, d: gate.wait(30) and real(p, d))
        store.put(b"a" * 16, block(1))
        store.put(b"b" * 16, block(2))
        before = store.load_cost["disk"]
        assert store.load(b"b" * 16, lambda data: None)  # from memory, microseconds
        assert store.load_cost["disk"] == before
        gate.set()
        store.writer.flush()


def test_loading_is_chosen_only_when_it_is_cheaper_than_recomputing():
    store = TierStore(host_bytes=10_000)
    store.put(b"x" * 16, block(0, 4000))
    assert store.worth_loading("host", 16)  # nothing measured yet: load
    store.observe_prefill(tokens=1000, seconds=0.001)  # a very fast prefill: 1 us per token
    store.load_cost["disk"] = 1e-6  # and a slow disk: 4 ms for this block
    assert store.worth_loading("host", 16) and not store.worth_loading("disk", 16)


def test_a_killed_node_s_disk_tier_is_not_left_to_fill_the_disk(tmp_path):
    """A node killed before close() left its disk tier's files: in a folder of its own (the
    default, per process) for good, and in a given folder outside the next process's count
    (`disk_used`), past --kv-disk-cache-gb. Folders are swept by their lock, not a pid: one
    held by a live store (any host sharing the folder) stays."""
    import pytest

    from pdserve.common.engine.tiers import TierStore, sweep_dead_tiers
    from pdserve.common.errors import ConfigError

    given = tmp_path / "given"
    given.mkdir()
    (given / ("ab" * 16 + ".kv")).write_bytes(b"x" * 100)
    (given / "cd.tmp").write_bytes(b"y")
    store = TierStore(0, 1 << 20, given)
    assert not list(given.iterdir()) and store.disk_used == 0
    with pytest.raises(ConfigError, match="another live node"):  # two stores, one folder
        TierStore(0, 1 << 20, given)
    root = tmp_path / "kv-tier"
    dead = TierStore(0, 1 << 20, root / "prefill-0-1")
    dead.put(b"\x02" * 16, b"d" * 64)
    dead.writer.flush()  # its write landed: a .tmp renamed mid-sweep is not this test's case
    os.close(dead.lock)  # as a kill would: its lock goes, its files stay
    live = TierStore(0, 1 << 20, root / "decode-0-2")
    live.put(b"\x03" * 16, b"l" * 64)
    (root / "other").mkdir()  # no lock: not a store's (or one being made), left alone
    sweep_dead_tiers(root)
    assert not (root / "prefill-0-1").exists() and (root / "other").exists()
    assert live.take(b"\x03" * 16) == b"l" * 64
    store.close()
    assert TierStore(0, 1 << 20, given).lock >= 0  # closed: the folder is free again


def test_nodes_given_one_disk_folder_each_keep_their_own(tmp_path):
    """`pdserve up --kv-disk-cache-dir D` gives every node the same flags: nodes shared one
    folder, evicted each other's files and cleared them at every start."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.node.runtime import make_tiers

    ecfg = EngineConfig(kv_disk_cache_gb=0.001, kv_disk_cache_dir=str(tmp_path))
    a, b = make_tiers(ecfg, "prefill-0"), make_tiers(ecfg, "prefill-1")
    assert a is not None and b is not None and a.dir != b.dir
    a.put(b"\x01" * 16, b"a" * 64)
    b.close()
    make_tiers(ecfg, "prefill-1")  # a restart of the other node clears only its own
    assert a.take(b"\x01" * 16) == b"a" * 64


def test_a_killed_node_s_folder_in_a_given_dir_is_swept_at_the_next_start(tmp_path):
    """With --kv-disk-cache-dir the folder is DIR/<node id>, and a default node id names the
    process: a killed node's folder was never reused nor swept, up to its disk budget for
    good. The next node's start sweeps the given folder too; a live node's stays."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.node.runtime import make_tiers

    ecfg = EngineConfig(kv_disk_cache_gb=0.001, kv_disk_cache_dir=str(tmp_path))
    dead, live = make_tiers(ecfg, "decode-h-11"), make_tiers(ecfg, "decode-h-12")
    assert dead is not None and live is not None
    dead.put(b"\x05" * 16, b"d" * 64)
    live.put(b"\x06" * 16, b"l" * 64)
    dead.writer.flush()  # its write landed (a .tmp renamed mid-sweep is another case)
    os.close(dead.lock)  # killed: its lock goes with the process, its files stay
    (tmp_path / "notes").mkdir()  # the operator's, beside an unheld lock of its own name
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "notes.lock").touch()
    make_tiers(ecfg, "decode-h-13")
    assert not (tmp_path / "decode-h-11").exists()
    assert not (tmp_path / "decode-h-11.lock").exists()
    assert live.take(b"\x06" * 16) == b"l" * 64 and (tmp_path / "decode-h-12").is_dir()
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"  # not a tier's: kept


def test_a_folder_on_a_filesystem_without_locks_is_served_and_never_swept(tmp_path, monkeypatch):
    """flock failing for want of support (ENOLCK: some network and FUSE mounts) read as
    "another live node's": the node refused to start. It is served unguarded now, and no
    sweep removes a folder whose lock it cannot take."""
    import errno
    import fcntl

    from pdserve.common.engine import tiers

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    store = tiers.TierStore(0, 1 << 20, tmp_path / "kv-tier" / "decode-0-1")
    store.put(b"\x04" * 16, b"n" * 64)
    assert store.lock < 0 and store.take(b"\x04" * 16) == b"n" * 64
    (tmp_path / "kv-tier" / "decode-0-1.lock").touch()  # as a store on a locking host made
    tiers.sweep_dead_tiers(tmp_path / "kv-tier")
    assert store.take(b"\x04" * 16) == b"n" * 64


def test_a_node_starting_while_another_sweeps_its_old_folder_waits_and_starts(
    tmp_path, monkeypatch
):
    """Every node of `pdserve up --kv-disk-cache-dir D` sweeps D's dead folders at start, and
    after a restart a dead folder is a sibling's starting now under the same name: the node
    found its lock held by the sweeper and failed its start ("another live node's"). It waits
    out the sweep, and makes its folder under its own lock (the sweep deleted it after)."""
    import fcntl
    import threading

    from pdserve.common.engine.tiers import LOCK

    folder = tmp_path / "prefill-0"
    folder.mkdir()
    (folder / ("ab" * 16 + ".kv")).write_bytes(b"x" * 100)
    lock = folder.with_name(folder.name + LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the sweeper holds the dead folder's lock
    started = threading.Event()

    def sweep_on() -> None:  # what sweep_dead_tiers does next, once the store is waiting
        started.wait(5)
        (folder / ("ab" * 16 + ".kv")).unlink()
        folder.rmdir()
        lock.unlink()
        os.close(fd)

    sweeper = threading.Thread(target=sweep_on)
    sweeper.start()
    import pdserve.common.engine.tiers as tiers

    real = tiers._hold

    def hold(f: Path) -> int:
        got = real(f)
        started.set()
        return got

    monkeypatch.setattr(tiers, "_hold", hold)
    try:
        store = TierStore(0, 1 << 20, folder)
    finally:
        sweeper.join()
    assert store.lock >= 0 and folder.is_dir() and lock.exists()
    store.put(b"\x07" * 16, b"z" * 64)
    assert store.take(b"\x07" * 16) == b"z" * 64
    with open(lock, "rb") as again:  # the lock on the path is the store's: held
        try:
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the store's lock is not the one at the path")
        except BlockingIOError:
            pass


def test_two_nodes_sweeping_one_dead_folder_at_once_both_start(tmp_path, monkeypatch):
    """Every node of `pdserve up --kv-disk-cache-dir D` sweeps D as it starts: one sweep
    deleted a dead folder between another's look at it and that one taking its lock, and the
    other's listing of the folder raised FileNotFoundError out of the node's start."""
    import shutil

    import pdserve.common.engine.tiers as tiers

    dead = TierStore(0, 1 << 20, tmp_path / "decode-0")
    dead.put(b"\x08" * 16, b"d" * 64)
    # its write landed: the writer thread renaming its .tmp under the rmtree below raced it
    dead.writer.flush()
    os.close(dead.lock)  # killed
    real = tiers._hold

    def hold_after_the_other_sweep(folder: Path) -> int:
        shutil.rmtree(folder)  # the other sweep, done first (its lock file stays: remade)
        return real(folder)

    monkeypatch.setattr(tiers, "_hold", hold_after_the_other_sweep)
    tiers.sweep_dead_tiers(tmp_path)
    monkeypatch.setattr(tiers, "_hold", real)
    assert not (tmp_path / "decode-0").exists()
    again = TierStore(0, 1 << 20, tmp_path / "decode-0")  # the lock is free: its node starts
    assert again.lock >= 0
