"""The disk tier's writes, on a thread of their own (common/engine/tiers.py).

A spill is a whole block written to a file (megabytes on a large model) and checksummed, and
the scheduler that evicts blocks runs on the node's event loop: a burst of evictions held
the loop (heartbeats, token sends) for the length of every write. Here the loop only hands
the bytes over; a block waiting to be written is served from them (`pending`), and one
dropped before or while it is written never stays on disk (`cancel`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from pdserve.common.engine.path_queue import PathQueue

log = logging.getLogger(__name__)
MAGIC = b"PDKVBLK1"
CHECK = 16  # bytes of blake2b
# bytes waiting to be written at most: past it a spill is dropped (the block is in no tier,
# recomputed if asked for) rather than held in memory without bound while the disk is slow
MAX_PENDING = 256 * 2**20


def _check(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECK).digest()


def write_block(path: Path, data: bytes) -> bool:
    """Write one block file whole (a temporary file renamed: never a torn one in place)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(MAGIC + _check(data) + data)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("KV disk tier: cannot write %s: %s", path, exc)
        with contextlib.suppress(OSError):  # a partial write (disk full): in no budget
            tmp.unlink(missing_ok=True)
        return False


def read_block(path: Path) -> bytes | None:
    """A block file's bytes, or None when it is gone or does not match its checksum."""
    try:
        body = path.read_bytes()
    except OSError:
        body = b""
    data = body[len(MAGIC) + CHECK :]
    if not body.startswith(MAGIC) or _check(data) != body[len(MAGIC) : len(MAGIC) + CHECK]:
        log.warning("KV disk tier: %s is missing or corrupt; dropping it", path)
        return None
    return data


class DiskWriter:
    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self.pending_bytes = 0  # waiting and being written
        self.jobs = PathQueue("kv-disk-tier", write_block, self._done)
        self.cond = self.jobs.cond
        self.cancelled: set[Path] = set()  # dropped while being written: removed after
        self.failed: list[Path] = []  # writes that failed, for the store to forget

    def submit(self, path: Path, data: bytes) -> bool:
        """Hand a block over to be written; False (not taken) past `max_pending` or closed."""
        with self.cond:
            old = self.jobs.queue.pop(path, b"")
            self.pending_bytes -= len(old)
            if self.jobs.closing or self.pending_bytes + len(data) > self.max_pending:
                return False
            self.pending_bytes += len(data)
            self.jobs.put(path, data)
            return True

    def pending(self, path: Path) -> bytes | None:
        """The bytes of a block not yet on disk (being written, or waiting)."""
        with self.cond:
            current = self.jobs.current_item if self.jobs.current == path else None
            return self.jobs.queue.get(path, current)

    def cancel(self, path: Path) -> bool:
        """Drop a block: True when no file of it will be left (never written, or removed by
        the writer once its write ends); False: the caller removes the file."""
        with self.cond:
            queued = self.jobs.queue.pop(path, None)
            self.pending_bytes -= len(queued or b"")
            if self.jobs.current == path:
                self.cancelled.add(path)
                return True
            return queued is not None

    def take_failed(self) -> list[Path]:
        with self.cond:
            failed, self.failed = self.failed, []
            return failed

    def flush(self) -> None:
        """Wait until everything handed over is written."""
        with self.cond:
            self.cond.wait_for(lambda: not self.jobs.queue and self.jobs.current is None)

    def close(self) -> None:
        self.jobs.close()
        with self.cond:
            self.pending_bytes = 0

    def _done(self, path: Path, data: bytes, ok: bool | None) -> None:
        """Under the lock: the write of `path` ended."""
        self.pending_bytes -= len(data)
        if path in self.cancelled:
            self.cancelled.discard(path)
            if path not in self.jobs.queue:  # not handed over again meanwhile
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        elif not ok and path not in self.jobs.queue:
            self.failed.append(path)
