"""Lower tiers of the prefix cache: KV blocks evicted from the engine's cache, kept by their
chained hash in a host-memory pool, and what overflows that pool in a disk directory. Pure
Python over bytes: the engine reads and writes whole blocks (`KvStore.read_block`,
`write_block`), on CPU or GPU alike, so this code does not know where the cache lives.

Both tiers are capped in bytes and least recently used first out: the host pool spills its
oldest blocks to disk, the disk drops its oldest files. Each disk file holds a checksum of
its bytes; a block that does not match (a torn write, a full disk, tampering) is a miss and
is deleted, never loaded. A block comes back up (`load`) when a request's prefix continues in
a tier and loading it is cheaper than recomputing it: `worth_loading` compares the measured
time to load a block (bytes / the tier's observed bandwidth) with the measured time to
prefill its tokens.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from pdserve.common.engine.tier_reader import ReadAhead
from pdserve.common.engine.tier_writer import CHECK, MAGIC, DiskWriter, read_block
from pdserve.common.errors import ConfigError

log = logging.getLogger(__name__)


class TierStore:
    def __init__(self, host_bytes: int, disk_bytes: int = 0, disk_dir: str | Path = "") -> None:
        self.host_cap = host_bytes
        self.disk_cap = disk_bytes if disk_dir else 0
        self.dir = Path(disk_dir) if disk_dir else None
        self.lock = -1
        if self.dir is not None and self.disk_cap:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            self.lock = _hold_soon(self.dir)
            if self.lock == BUSY:
                raise ConfigError(f"the disk tier folder {self.dir} is another live node's")
            self.dir.mkdir(exist_ok=True)  # under the lock: a sweep removes one only under it
            if self.lock == NO_LOCKS:  # no sweep can take it then: served, unguarded
                log.warning("KV disk tier: %s has no file locks; not guarded", self.dir)
            # a previous process's blocks (one killed: close() never ran): its index went
            # with it, so they would fill the disk outside `disk_used` for good
            for stale in [*self.dir.glob("*.kv"), *self.dir.glob("*.tmp")]:
                stale.unlink(missing_ok=True)
        self.host: OrderedDict[bytes, bytes] = OrderedDict()
        self.host_used = 0
        self.disk: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size
        self.disk_used = 0
        self.writer = DiskWriter()  # off the event loop the scheduler runs on
        self.ahead: ReadAhead | None = None  # reads too, once a node asks (`read_ahead`)
        # observed seconds per byte of a load, per tier (starts from conservative guesses:
        # host memory 2 GB/s, a disk 200 MB/s), and seconds per prefilled token
        self.load_cost = {"host": 1 / 2e9, "disk": 1 / 2e8}
        self.token_cost = 0.0  # unknown until the node reports a prefill
        self.block_nbytes = 0
        self.stats = {"put": 0, "spilled": 0, "host_hits": 0, "disk_hits": 0, "corrupt": 0,
                      "dropped": 0}  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.host_cap > 0 or self.disk_cap > 0

    # -- in ----------------------------------------------------------------------------------
    def put(self, digest: bytes, data: bytes) -> None:
        """A block leaves the engine's cache: keep it (host first, spilling to disk)."""
        self._forget_failed()
        if digest in self.host or digest in self.disk:
            # evicted again (it was loaded back, or is a copy): as recently used as a take
            (self.host if digest in self.host else self.disk).move_to_end(digest)
            return
        self.stats["put"] += 1
        self.block_nbytes = len(data)
        if self.host_cap >= len(data):
            self.host[digest] = data
            self.host_used += len(data)
            while self.host_used > self.host_cap:
                old, old_data = self.host.popitem(last=False)
                self.host_used -= len(old_data)
                self._to_disk(old, old_data)
        else:
            self._to_disk(digest, data)

    def _to_disk(self, digest: bytes, data: bytes) -> None:
        if self.dir is None or self.disk_cap < len(data):
            return
        if not self.writer.submit(self._path(digest), data):  # the disk far behind: dropped
            self.stats["dropped"] += 1
            return
        self.disk[digest] = len(MAGIC) + CHECK + len(data)
        self.disk_used += self.disk[digest]
        self.stats["spilled"] += 1
        while self.disk_used > self.disk_cap:
            old, size = self.disk.popitem(last=False)
            self.disk_used -= size
            self._unlink(old)

    def _path(self, digest: bytes) -> Path:
        assert self.dir is not None
        return self.dir / (digest.hex() + ".kv")

    def _forget_failed(self) -> None:
        """Blocks whose background write failed (a full disk) are in no tier."""
        for path in self.writer.take_failed():
            size = self.disk.pop(bytes.fromhex(path.stem), None)
            self.disk_used -= size or 0
            if self.ahead is not None:  # a read of it (None: no file) would serve the next
                self.ahead.drop(path)  # block written under its name, deleted as corrupt

    # -- out ---------------------------------------------------------------------------------
    def read_ahead(self, on_ready: Callable[[], object]) -> None:
        """Read disk blocks on a thread ahead of their load (`ready`), calling `on_ready`
        (thread-safe) when an owner's reads are all done, or a block it waits on left the
        tier (then on the caller's thread)."""
        if self.dir is not None and self.disk_cap and self.ahead is None:
            self.ahead = ReadAhead(on_ready)

    def ready(self, digests: list[bytes], owner: str) -> bool:
        """Whether loading `digests` now reads no disk on the caller's thread: each in host
        memory, still waiting to be written, or read ahead. The reads of the others start
        (False until they end), kept for `owner` until `release`d (shared with any other
        owner asking for the same blocks); past the read-ahead's cap (bytes queued, being read
        or read) the rest are read by the load. Always True without read-ahead (loads read
        as they go)."""
        if self.ahead is None:
            return True
        done = True
        for digest in digests:
            path = self._path(digest)
            if self.where(digest) == "disk" and self.writer.pending(path) is None:
                # each asked for, done or not; its file's size reserved against the cap
                done = self.ahead.want(path, owner, self.disk[digest]) and done
        return done

    def release(self, owner: str) -> None:
        """`owner` needs none of what it asked `ready` for now (loaded, or it ended): the
        bytes read for it alone are let go, its reads not begun are not made."""
        if self.ahead is not None:
            self.ahead.release(owner)

    def where(self, digest: bytes) -> str | None:
        self._forget_failed()
        if digest in self.host:
            return "host"
        if digest in self.disk:
            return "disk"
        return None

    def worth_loading(self, tier: str, tokens: int) -> bool:
        """Loading a block from `tier` costs less than prefilling its `tokens` (measured)."""
        if not self.token_cost:
            return True  # nothing measured yet: loading is the better bet on every device
        return self.block_nbytes * self.load_cost[tier] < tokens * self.token_cost

    def load(self, digest: bytes, write: Callable[[bytes], None]) -> bool:
        """Copy the block into the engine's cache with `write`; False if no tier has it. Timed
        whole, read and copy, as that is what `worth_loading` weighs (a host hit alone is a
        dict lookup: timed alone, loading from host memory looked free)."""
        started = time.perf_counter()
        data, source, ahead = self._take(digest)
        if data is None:
            return False
        write(data)
        seconds = time.perf_counter() - started + ahead  # a read ahead took its time too
        if seconds > 0 and source in self.load_cost:  # not a block still waiting to be
            # written: served from memory, it would make the disk look as fast
            self.load_cost[source] = 0.8 * self.load_cost[source] + 0.2 * (seconds / len(data))
        return True

    def take(self, digest: bytes) -> bytes | None:
        """The block's bytes, checked, from whichever tier holds it (it stays there)."""
        return self._take(digest)[0]

    def _take(self, digest: bytes) -> tuple[bytes | None, str, float]:
        """The bytes, where they came from (host, disk, or pending: not written yet) and the
        seconds a read ahead of this took."""
        data = self.host.get(digest)
        if data is not None:
            self.host.move_to_end(digest)
            self.stats["host_hits"] += 1
            return data, "host", 0.0
        self._forget_failed()
        if digest not in self.disk or self.dir is None:
            return None, "", 0.0
        path = self._path(digest)
        data, source, ahead = self.writer.pending(path), "pending", 0.0  # not written yet
        found = data is not None
        if not found and self.ahead is not None:
            found, data, ahead = self.ahead.take(path)
            source = "disk"
        if not found:
            data, source = read_block(path), "disk"
        if data is None:
            self.stats["corrupt"] += 1
            self.disk_used -= self.disk.pop(digest)
            self._unlink(digest)
            return None, "", 0.0
        self.disk.move_to_end(digest)
        self.stats["disk_hits"] += 1
        return data, source, ahead

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The node computed `tokens` of prefill in `seconds`: the cost of recomputing."""
        if tokens > 0 and seconds > 0:
            per = seconds / tokens
            self.token_cost = per if not self.token_cost else 0.8 * self.token_cost + 0.2 * per

    def _unlink(self, digest: bytes) -> None:
        if self.dir is None:
            return
        path = self._path(digest)
        if self.ahead is not None:
            self.ahead.drop(path)
        if not self.writer.cancel(path):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop the disk tier's files (they belong to this process's cache)."""
        self.writer.close()  # its last write ends first: no file appears after the sweep
        if self.ahead is not None:
            self.ahead.close()
        for digest in list(self.disk):
            self._unlink(digest)
        self.disk.clear()
        self.disk_used = 0
        if self.lock >= 0:
            os.close(self.lock)  # the folder is anyone's to sweep now
            self.lock = -1


LOCK = ".lock"  # beside a folder: held (flock) by its live store, on whatever host shares it
TRASH = "+trash-"  # a dead folder renamed aside to be deleted ("+": in no node id)


BUSY, NO_LOCKS = -1, -2  # _hold: another process holds it; the filesystem has no flock


def _hold(folder: Path) -> int:
    """The descriptor of `folder`'s lock, held exclusively, or BUSY, or NO_LOCKS. A new lock
    is made under another name, locked, then linked into place (a link fails if another
    process made one meanwhile): a sweep never sees it unheld, and two never both hold it."""
    path = folder.with_name(folder.name + LOCK)
    if not path.exists():
        draft = folder.with_name(f"{folder.name}{LOCK}.{os.getpid()}")
        fd = _locked(os.open(draft, os.O_RDWR | os.O_CREAT, 0o600))
        try:
            if fd >= 0:
                os.link(draft, path)
                return fd
        except FileExistsError:  # another made it first: take that one
            os.close(fd)
        except OSError:  # no hard links here (some FUSE mounts): renamed instead
            os.replace(draft, path)
            return fd
        finally:
            draft.unlink(missing_ok=True)
        if fd == NO_LOCKS:
            return fd
    fd = _locked(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if fd >= 0 and not _still_at(fd, path):  # a sweep unlinked it between our open and lock
        os.close(fd)
        return _hold(folder)
    return fd


def _hold_soon(folder: Path, wait_s: float = 2.0) -> int:
    """`_hold`, waiting out a sweep: a node starting sweeps every dead folder of a shared
    root, holding its lock a moment, while the node named by it may be starting too."""
    deadline = time.monotonic() + wait_s
    while (fd := _hold(folder)) == BUSY and time.monotonic() < deadline:
        time.sleep(0.05)
    return fd


def _still_at(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _locked(fd: int) -> int:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        os.close(fd)
        return BUSY if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else NO_LOCKS


def sweep_dead_tiers(root: Path) -> None:
    """Remove the tier folders under `root` no live store holds (their process killed before
    close()), so node restarts do not pile disk tiers up. By the folder's lock, not its pid:
    a cache folder shared by hosts or PID namespaces holds others' live folders too. `root`
    may be the operator's own (--kv-disk-cache-dir): a folder holding anything but blocks is
    not a tier's, and stays. Under the lock a dead folder is only renamed aside (its node,
    restarting, waits on that lock a moment), then deleted without it."""
    for folder in root.iterdir() if root.is_dir() else []:
        if TRASH in folder.name:  # renamed aside by a sweep that did not finish deleting it
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if not folder.is_dir() or not folder.with_name(folder.name + LOCK).exists():
            continue  # a lock, not a store's, or one being made (its lock comes next)
        fd = _hold(folder)  # held by a live store, or no locks here: left alone
        if fd < 0:
            continue
        trash = folder.with_name(f"{folder.name}{TRASH}{os.getpid()}-{time.monotonic_ns()}")
        try:
            if all(f.suffix in (".kv", ".tmp") and f.is_file() for f in folder.iterdir()):
                folder.rename(trash)
                folder.with_name(folder.name + LOCK).unlink(missing_ok=True)
        except FileNotFoundError:  # another sweep took it first
            pass
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
