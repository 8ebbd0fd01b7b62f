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

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from pdserve.common.engine.tier_writer import read_block

log = logging.getLogger(__name__)
# bytes read ahead and not taken yet at most: past it a sequence loads the rest as before
MAX_READY = 256 * 2**20
KEEP_S = 30.0  # a block read and not taken this long (its sequence aborted) is let go


class ReadAhead:
    def __init__(self, on_ready: Callable[[], object], max_ready: int = MAX_READY) -> None:
        self.on_ready = on_ready  # from the reading thread: must be thread-safe
        self.max_ready = max_ready
        self.cond = threading.Condition()
        self.queue: OrderedDict[Path, None] = OrderedDict()  # to read, oldest first
        self.current: Path | None = None
        # read: the bytes (None: missing or corrupt) and the seconds the read took
        self.ready: dict[Path, tuple[bytes | None, float]] = {}
        self.ready_at: OrderedDict[Path, float] = OrderedDict()  # when each was read
        self.ready_bytes = 0
        self.dropped: set[Path] = set()  # dropped while being read: not kept
        self.thread: threading.Thread | None = None
        self.closing = False

    def want(self, path: Path) -> bool:
        """True once `path` is read (its result waits in `ready`); False while it is being
        read, or queued now. Past `max_ready` True at once: the caller reads it itself."""
        with self.cond:
            if path in self.ready or self.closing:
                return True
            if path in self.queue or path == self.current:
                return False
            self._let_go(time.monotonic())
            if self.ready_bytes >= self.max_ready:
                return True
            self.queue[path] = None
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="kv-tier-read", daemon=True)
                self.thread.start()
            self.cond.notify()
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
            queued = path in self.queue
            self.queue.pop(path, None)
            self._pop(path)
            if path == self.current:
                self.dropped.add(path)
            wake = queued and not self.queue and self.current is None
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
        with self.cond:
            self.closing = True
            self.queue.clear()
            self.ready.clear()
            self.ready_at.clear()
            self.ready_bytes = 0
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.closing)
                if self.closing:
                    return
                path, _ = self.queue.popitem(last=False)
                self.current = path
            started = time.perf_counter()
            data: bytes | None = None
            try:
                data = read_block(path)
            except Exception:  # never a dead reader: the sequences waiting would wait on
                log.exception("KV disk tier: reading %s failed", path)
            with self.cond:
                self.current = None
                if path in self.dropped:
                    self.dropped.discard(path)
                elif not self.closing:
                    self.ready[path] = (data, time.perf_counter() - started)
                    self.ready_at[path] = time.monotonic()
                    self.ready_bytes += len(data or b"")
                idle = not self.queue
            if idle:  # one wake-up for a run of blocks, not one per block
                try:
                    self.on_ready()
                except Exception:
                    log.exception("KV disk tier: waking the step loop failed")
