"""The disk tier's reads, ahead of the step that loads them, on a thread of their own
(common/engine/tiers.py).

A disk block's load is a file read and a checksum (about 2 ms for a SmolLM2 float32 block,
docs/results §6), and the scheduler that loads runs on the node's event loop: a long prefix
continuing on disk held every stream's tokens for tenths of a second. With read-ahead on
(a node sets `on_ready`), the scheduler asks for a sequence's disk blocks and leaves it
waiting while others run; the thread reads and checks them, says so, and the sequence is
scheduled with its blocks in memory.

Reads are asked for by an owner (a waiting sequence's id) and kept for their owners: one
block asked for by many (a burst sharing a prefix) is read once and serves them all, the
step loop is woken as each owner's last read ends (a short prefix does not wait behind a
long one), and what an owner asked for is let go when it no longer waits (`release`: it
was admitted, or it ended), so the bytes held are what waiting sequences need.

The cap counts a block from when its read is queued (its file's size, reserved) until it is
let go: the blocks queued, being read and read are never more than `max_ready` bytes. The
scheduler asks in its queue's order, so the head's blocks are reserved, and read, first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pdserve.common.engine.path_queue import PathQueue
from pdserve.common.engine.tier_writer import read_block

# bytes reserved for waiting sequences' reads at most (queued, being read or read): past it a
# sequence loads the rest as before, on the caller's thread
MAX_READY = 256 * 2**20


class ReadAhead:
    def __init__(self, on_ready: Callable[[], object], max_ready: int = MAX_READY) -> None:
        # called on the reading thread, and on the scheduler's too (`drop`, mid-schedule, as a
        # block leaves the tier): must be thread-safe; never under the lock
        self.on_ready = on_ready
        self.max_ready = max_ready
        self.jobs = PathQueue("kv-tier-read", _timed_read, self._done)
        self.cond = self.jobs.cond
        # read: the bytes (None: missing or corrupt) and the seconds the read took
        self.ready: dict[Path, tuple[bytes | None, float]] = {}
        self.ready_bytes = 0
        # each block queued, being read or read: its file's size, counted against `max_ready`
        self.reserved: dict[Path, int] = {}
        self.reserved_bytes = 0
        self.owners: dict[Path, set[str]] = {}  # who asked for each block queued, read or ready
        self.asked: dict[str, set[Path]] = {}  # each owner's blocks (the same claims)
        self.unread: dict[str, int] = {}  # each owner's blocks not ready yet
        self.dropped: set[Path] = set()  # dropped while being read: not kept

    def want(self, path: Path, owner: str, nbytes: int) -> bool:
        """True once `path` is read (its result waits in `ready`, kept for `owner`); False
        while it is being read, or queued now (`nbytes`, its file's size, reserved). When
        those would pass `max_ready`, True at once: the caller reads it itself."""
        with self.cond:
            if self.jobs.closing:
                return True
            if path in self.ready:
                self._claim(path, owner, unread=False)
                return True
            if path not in self.reserved:  # neither queued nor being read
                if self.reserved_bytes + nbytes > self.max_ready:
                    return True
                self.reserved[path] = nbytes
                self.reserved_bytes += nbytes
                self.jobs.put(path, None)
            self._claim(path, owner, unread=True)
            return False

    def take(self, path: Path) -> tuple[bool, bytes | None, float]:
        """(found, bytes or None if unreadable, seconds the read took). Kept while an owner
        asks for it (others sharing the block load it too): `release` lets it go."""
        with self.cond:
            got = self.ready.get(path)
            return (False, None, 0.0) if got is None else (True, *got)

    def release(self, owner: str) -> None:
        """`owner` waits no more (admitted, or ended): what it alone asked for is let go,
        read or not (a read under way is not kept when it ends)."""
        with self.cond:
            self.unread.pop(owner, None)
            for path in self.asked.pop(owner, ()):
                owners = self.owners[path]
                owners.discard(owner)
                if not owners:
                    del self.owners[path]
                    self._let_go(path)

    def drop(self, path: Path) -> None:
        """The block left the tier: neither read nor kept for it. A sequence waiting on it
        alone is woken (it computes that block instead)."""
        with self.cond:
            unread = path not in self.ready
            self._let_go(path)
            if path == self.jobs.current:
                self.dropped.add(path)
            owners = self.owners.pop(path, set())
            for owner in owners:
                self.asked[owner].discard(path)
            wake = unread and self._count_down(owners)
        if wake:  # its read would have woken the step loop; none comes now
            self.on_ready()

    def close(self) -> None:
        self.jobs.close()
        with self.cond:
            self.ready.clear()
            self.ready_bytes = 0
            self.reserved.clear()
            self.reserved_bytes = 0
            self.owners.clear()
            self.asked.clear()
            self.unread.clear()

    def _claim(self, path: Path, owner: str, unread: bool) -> None:
        owners = self.owners.setdefault(path, set())
        if owner not in owners:
            owners.add(owner)
            self.asked.setdefault(owner, set()).add(path)
            self.unread[owner] = self.unread.get(owner, 0) + int(unread)

    def _count_down(self, owners: Iterable[str]) -> bool:
        """One more block of each owner is ready (or gone): True if one has all of its."""
        done = False
        for owner in owners:
            self.unread[owner] -= 1
            done = done or self.unread[owner] == 0
        return done

    def _let_go(self, path: Path) -> None:
        """Neither read nor kept for anyone: its reservation given back, unless it is being
        read (until that read ends, `_done`: the bytes are in memory until then)."""
        self.jobs.queue.pop(path, None)
        got = self.ready.pop(path, None)
        if got is not None:
            self.ready_bytes -= len(got[0] or b"")
        if path != self.jobs.current:
            self.reserved_bytes -= self.reserved.pop(path, 0)

    def _done(
        self, path: Path, _: None, got: tuple[bytes | None, float] | None
    ) -> Callable[[], object] | None:
        """Under the lock: the read of `path` ended; the wake-up once an owner's reads are
        all in (one call however many owners: a burst sharing a prefix wakes once)."""
        owners = self.owners.get(path)
        if self.jobs.closing or not owners:  # nobody waits for it now
            self.dropped.discard(path)
            self.reserved_bytes -= self.reserved.pop(path, 0)
            return None
        if path in self.dropped:  # the block left the tier, then was asked for again
            self.dropped.discard(path)
            self.jobs.put(path, None)  # what was read may be the old file's: read anew
            return None
        self.ready[path] = got or (None, 0.0)  # None: the read raised
        self.ready_bytes += len(self.ready[path][0] or b"")
        return self.on_ready if self._count_down(owners) else None


def _timed_read(path: Path, _: None) -> tuple[bytes | None, float]:
    started = time.perf_counter()
    data = read_block(path)
    return data, time.perf_counter() - started
