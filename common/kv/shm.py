"""The shm backend: same-host KV transfer through files in /dev/shm, mapped by both sides.

Used between nodes that registered the same host identity (kernel boot id and IPC namespace,
common/node/host.py): the prefill node exports each layer straight into a segment lent to the
request, only a descriptor crosses ZeroMQ, and the decode node copies once into its cache.

The prefill node keeps a pool of segments and reuses them (fresh pages cost 3-7x a warm
copy), so a steady stream of requests maps no new memory. A segment is lent to one request
from its header until the decode node answers it (KvAck, KvRefuse) and then returned: the
decode node reads a layer only when it handles its KvLayer, maybe long after it was sent. An
aborted transfer's segment is destroyed instead (unlinked, never lent again), since the
decode node may still read it and admit what it finds. The decode node keeps each segment it
has seen mapped, keyed by name, for the same reason, and lets go of those whose file is gone.

Segments are allocated whole when made (a tmpfs that runs out while pages are touched kills
the process with SIGBUS; a full one is an OSError here, and the transfer goes by ZeroMQ). A
pool's owner file is locked for the pool's life: the segments of a node that crashed are
swept by the next node to start on the host (common/ofd.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pdserve.common.kv.base import (
    Backend,
    Intake,
    Local,
    ReceiveConnector,
    SendConnector,
    Transfer,
)
from pdserve.common.ofd import (
    SEG_FILE_PREFIX,
    SEG_OWNER_SUFFIX,
    SHM_DIR,
    lock_byte,
    sweep_dead_kv_files,
)

PRUNE_S = 2.0  # the decode side lets go of destroyed segments' mappings this often


@dataclass
class Segment:
    name: str
    size: int
    mem: mmap.mmap
    users: int = 0  # decode side: intakes that read it (its mapping is kept while they do)

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.mem)[offset : offset + length]


def _create(path: str, size: int) -> mmap.mmap:
    """A new segment, its pages allocated now: a full /dev/shm is an OSError here (the
    transfer goes by zmq), not SIGBUS at a write, nor a failed batch. On the event loop
    (~80 ms for 256 MiB), paid only when the pool grows: segments are reused."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _open(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _own(path: str) -> int:
    """The pool's owner file, locked (byte 0) while the returned descriptor is open: made
    and locked under another name, then renamed, so a sweep never sees it unlocked."""
    draft = os.path.join(SHM_DIR, f"pdserve-segdraft-{secrets.token_hex(6)}")
    fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not lock_byte(fd, 0):
            raise OSError(f"cannot lock {draft}")
        os.rename(draft, path)
    except BaseException:
        os.close(fd)
        os.unlink(draft)
        raise
    return fd


class SegmentPool:
    """Prefill side: lend segments of at least `size` bytes, reuse returned ones."""

    def __init__(self, prefix: str, max_free: int = 8) -> None:
        self.prefix = f"{SEG_FILE_PREFIX}{prefix}-{secrets.token_hex(3)}"
        self.owner_path = os.path.join(SHM_DIR, self.prefix + SEG_OWNER_SUFFIX)
        self.owner = -1  # the owner file's descriptor, from the first segment on
        self.free: list[Segment] = []
        self.all: list[Segment] = []
        self.max_free = max_free
        # a name is never reused: destroying a segment must not free a name that a live one
        # has (a count of live segments would hand it out again)
        self.serial = itertools.count()

    def take(self, size: int) -> Segment:
        """A segment to lend; OSError where /dev/shm has no room for a new one."""
        fits = [s for s in self.free if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.free.remove(seg)
            return seg
        if self.owner < 0:  # no file I/O before (a sender is made to ask `usable`)
            sweep_dead_kv_files()  # segments of this host's crashed nodes
            self.owner = _own(self.owner_path)
        name = f"{self.prefix}-{next(self.serial)}"
        size = max(1 << 20, 1 << (size - 1).bit_length())  # powers of two: reuse across sizes
        seg = Segment(name, size, _create(os.path.join(SHM_DIR, name), size))
        self.all.append(seg)
        return seg

    def give_back(self, seg: Segment) -> None:
        self.free.append(seg)
        if len(self.free) > self.max_free:  # keep the pool bounded: drop the smallest
            victim = min(self.free, key=lambda s: s.size)
            self.free.remove(victim)
            self.destroy(victim)

    def destroy(self, seg: Segment) -> None:
        """Never lent again: its pages live on only while a reader keeps them mapped."""
        self.all.remove(seg)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, seg.name))
        # a view may outlive its stage (a failed stage's traceback holds it while the step's
        # failure drops the request): then it is unmapped with the last view, not raised here
        with contextlib.suppress(BufferError):
            seg.mem.close()

    def close(self) -> None:
        for seg in list(self.all):
            self.destroy(seg)
        self.free.clear()
        if self.owner >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.owner_path)
            os.close(self.owner)  # the lock goes with it
            self.owner = -1


class SegmentMaps:
    """Decode side: segments by name, mapped once and kept while their file exists or an
    intake reads them: a sender's pool destroys segments (more than `max_free` free, an
    abort, its restart), and a mapping kept would hold an unlinked file's memory in
    /dev/shm for good."""

    def __init__(self) -> None:
        self.maps: dict[str, Segment] = {}

    def get(self, name: str, size: int, sender: str) -> Segment:
        """The segment for an intake to read (`done` when it ends)."""
        # only a segment of the sending node's pool (never a node's KV cache file, or
        # another sender's live segment)
        pattern = rf"{SEG_FILE_PREFIX}{re.escape(sender)}-[0-9a-f]{{6}}-\d+"
        if not re.fullmatch(pattern, name):
            raise ValueError(f"refusing shared-memory name {name!r} from {sender}")
        seg = self.maps.get(name)
        if seg is None:
            self.prune()
            mem = _open(os.path.join(SHM_DIR, name))
            seg = self.maps[name] = Segment(name, len(mem), mem)
        if seg.size < size:
            raise ValueError(f"segment {name} has {seg.size} bytes, need {size}")
        seg.users += 1
        return seg

    def done(self, seg: Segment) -> None:
        seg.users -= 1

    def prune(self) -> None:
        """Let go of segments no intake reads whose file is gone."""
        for name, seg in list(self.maps.items()):
            if seg.users <= 0 and not os.path.exists(os.path.join(SHM_DIR, name)):
                try:
                    seg.mem.close()
                except BufferError:  # a frame still reads it: forgotten on a later call
                    continue
                del self.maps[name]

    def close(self) -> None:
        for seg in self.maps.values():
            seg.mem.close()
        self.maps.clear()


class ShmSend(SendConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.pool = SegmentPool(local.node_id)

    def usable(self, endpoint: str) -> bool:
        return endpoint == self.local.host_id  # the peer shares our /dev/shm

    def begin(self, t: Transfer) -> None:
        seg = self.pool.take(t.total_bytes)
        t.state, t.location = seg, seg.name

    def stage(self, t: Transfer, layer: int) -> Any:
        view = t.state.view(layer * t.frame_bytes, t.frame_bytes)
        self.local.kv.export_into(layer, t.block_table, t.num_tokens, view)
        return None  # the frame is in the segment already

    def end(self, t: Transfer) -> None:
        if t.state is None:
            return
        if t.answered:  # the decode node reads it no more
            self.pool.give_back(t.state)
        else:  # aborted: its KvLayers may still be on their way
            self.pool.destroy(t.state)
        t.state = None

    async def close(self) -> None:
        self.pool.close()


class ShmReceive(ReceiveConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.maps = SegmentMaps()
        self.pruning: asyncio.Task | None = None

    async def listen(self, sink: Any) -> str:
        # after a burst no new name may come for long: the mappings of the segments its
        # sender destroyed are let go on a timer
        self.pruning = asyncio.create_task(self._prune_every(PRUNE_S))
        return self.local.host_id

    async def _prune_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            self.maps.prune()

    def open(self, rec: Intake) -> str | None:
        h = rec.header
        try:
            rec.state = self.maps.get(h.location, h.frame_bytes * h.num_layers, h.prefill_node)
        except (OSError, ValueError) as exc:
            return f"shared memory: {exc}"
        return None

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        size = rec.header.frame_bytes
        return rec.state.view(layer * size, size) if rec.state is not None else None

    def close_intake(self, rec: Intake) -> None:
        if rec.state is not None:
            self.maps.done(rec.state)
            rec.state = None

    async def close(self) -> None:
        if self.pruning is not None:
            self.pruning.cancel()
        self.maps.close()


CONNECTOR = Backend("shm", ShmSend, ShmReceive, auto_rank=0)
