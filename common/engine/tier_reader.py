"""The disk tier's reads, ahead of the step that loads them, on a thread of their own
(common/engine/tiers.py).

A disk block's load is a file read and a checksum (about 2 ms for a SmolLM2 float32 block,
docs/results §6), and the scheduler that loads runs on the node's event loop: a long prefix
continuing on disk held every stream's tokens for tenths of a second. With read-ahead on
(a node sets `on_ready`), the scheduler asks for a sequence's disk blocks and leaves it
waiting while others run; the thread reads and checks them, says so, and the sequence is
scheduled with its blocks in memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from pdserve.common.engine.path_queue import PathQueue
from pdserve.common.engine.tier_writer import read_block

# bytes read ahead and not taken yet at most: past it a sequence loads the rest as before
MAX_READY = 256 * 2**20
KEEP_S = 30.0  # a block read and not taken this long (its sequence aborted) is let go


class ReadAhead:
    def __init__(self, on_ready: Callable[[], object], max_ready: int = MAX_READY) -> None:
        self.on_ready = on_ready  # from the reading thread: must be thread-safe
        self.max_ready = max_ready
        self.jobs = PathQueue("kv-tier-read", _timed_read, self._done)
        self.cond = self.jobs.cond
        # read: the bytes (None: missing or corrupt) and the seconds the read took
        self.ready: dict[Path, tuple[bytes | None, float]] = {}
        self.ready_at: OrderedDict[Path, float] = OrderedDict()  # when each was read
        self.ready_bytes = 0
        self.dropped: set[Path] = set()  # dropped while being read: not kept

    def want(self, path: Path) -> bool:
        """True once `path` is read (its result waits in `ready`); False while it is being
        read, or queued now. Past `max_ready` True at once: the caller reads it itself."""
        with self.cond:
            if path in self.ready or self.jobs.closing:
                return True
            if path in self.jobs.queue or path == self.jobs.current:
                return False
            self._let_go(time.monotonic())
            if self.ready_bytes >= self.max_ready:
                return True
            self.jobs.put(path, None)
            return False

    def take(self, path: Path) -> tuple[bool, bytes | None, float]:
        """(found, bytes or None if unreadable, seconds the read took); forgotten after."""
        with self.cond:
            got = self._pop(path)
            return (False, None, 0.0) if got is None else (True, *got)

    def drop(self, path: Path) -> None:
        """The block left the tier: neither read nor kept for it. A sequence waiting on it
        is woken (it computes that block instead)."""
        with self.cond:
            queued = path in self.jobs.queue
            self.jobs.queue.pop(path, None)
            self._pop(path)
            if path == self.jobs.current:
                self.dropped.add(path)
            wake = queued and not self.jobs.queue and self.jobs.current is None
        if wake:  # its read would have woken the step loop; none comes now
            self.on_ready()

    def _pop(self, path: Path) -> tuple[bytes | None, float] | None:
        got = self.ready.pop(path, None)
        if got is not None:
            del self.ready_at[path]
            self.ready_bytes -= len(got[0] or b"")
        return got

    def _let_go(self, now: float) -> None:
        while self.ready_at and now - next(iter(self.ready_at.values())) > KEEP_S:
            self._pop(next(iter(self.ready_at)))

    def close(self) -> None:
        self.jobs.close()
        with self.cond:
            self.ready.clear()
            self.ready_at.clear()
            self.ready_bytes = 0

    def _done(
        self, path: Path, _: None, got: tuple[bytes | None, float] | None
    ) -> Callable[[], object] | None:
        """Under the lock: the read of `path` ended; the wake-up once a run of reads is."""
        if path in self.dropped:
            self.dropped.discard(path)
        elif not self.jobs.closing:
            self.ready[path] = got or (None, 0.0)  # None: the read raised
            self.ready_at[path] = time.monotonic()
            self.ready_bytes += len(self.ready[path][0] or b"")
        return self.on_ready if not self.jobs.queue else None  # one for a run of blocks


def _timed_read(path: Path, _: None) -> tuple[bytes | None, float]:
    started = time.perf_counter()
    data = read_block(path)
    return data, time.perf_counter() - started
