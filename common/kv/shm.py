"""The shm backend: same-host KV transfer through files in /dev/shm, mapped by both sides.

Used between nodes that registered the same host identity (kernel boot id and IPC namespace,
common/node/host.py): the prefill node exports each layer straight into a segment lent to the
request, only a descriptor crosses ZeroMQ, and the decode node copies once into its cache.

The prefill node keeps a pool of segments and reuses them (fresh pages cost 3-7x a warm
copy), so a steady stream of requests maps no new memory. A segment is lent to one request
from its header until its KvAck (or abort) and then returned. The decode node keeps each
segment it has seen mapped, keyed by name, for the same reason. Segment files are removed
when the prefill node closes its pool; a crashed node leaves them to the OS's tmpfs cleanup.
"""

from __future__ import annotations

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

SHM_DIR = "/dev/shm"


@dataclass
class Segment:
    name: str
    size: int
    mem: mmap.mmap

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.mem)[offset : offset + length]


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SegmentPool:
    """Prefill side: lend segments of at least `size` bytes, reuse returned ones."""

    def __init__(self, prefix: str, max_free: int = 8) -> None:
        self.prefix = f"pdserve-{prefix}-{secrets.token_hex(3)}"
        self.free: list[Segment] = []
        self.all: list[Segment] = []
        self.max_free = max_free
        # a name is never reused: destroying a segment must not free a name that a live one
        # has (a count of live segments would hand it out again)
        self.serial = itertools.count()

    def take(self, size: int) -> Segment:
        fits = [s for s in self.free if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.free.remove(seg)
            return seg
        name = f"{self.prefix}-{next(self.serial)}"
        size = max(1 << 20, 1 << (size - 1).bit_length())  # powers of two: reuse across sizes
        seg = Segment(name, size, _map(os.path.join(SHM_DIR, name), size, create=True))
        self.all.append(seg)
        return seg

    def give_back(self, seg: Segment) -> None:
        self.free.append(seg)
        if len(self.free) > self.max_free:  # keep the pool bounded: drop the smallest
            victim = min(self.free, key=lambda s: s.size)
            self.free.remove(victim)
            self._destroy(victim)

    def _destroy(self, seg: Segment) -> None:
        self.all.remove(seg)
        seg.mem.close()
        try:
            os.unlink(os.path.join(SHM_DIR, seg.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for seg in list(self.all):
            self._destroy(seg)
        self.free.clear()


class SegmentMaps:
    """Decode side: segments by name, mapped once and kept while their size fits, and while
    their file exists: a sender's pool destroys segments (more than `max_free` free, its
    restart), and a mapping kept would hold an unlinked file's memory in /dev/shm for good."""

    def __init__(self) -> None:
        self.maps: dict[str, Segment] = {}

    def get(self, name: str, size: int, sender: str) -> Segment:
        # only a segment of the sending node's pool (never a node's KV cache file, or
        # another sender's live segment)
        if not re.fullmatch(rf"pdserve-{re.escape(sender)}-[0-9a-f]{{6}}-\d+", name):
            raise ValueError(f"refusing shared-memory name {name!r} from {sender}")
        seg = self.maps.get(name)
        if seg is None:
            self._forget_unlinked()
        if seg is None or seg.size < size:
            path = os.path.join(SHM_DIR, name)
            real = os.path.getsize(path)
            if real < size:
                raise ValueError(f"segment {name} has {real} bytes, need {size}")
            if seg is not None:
                seg.mem.close()
            seg = Segment(name, real, _map(path, real, create=False))
            self.maps[name] = seg
        return seg

    def _forget_unlinked(self) -> None:
        for name, seg in list(self.maps.items()):
            if not os.path.exists(os.path.join(SHM_DIR, name)):
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
        if t.state is not None:
            self.pool.give_back(t.state)
            t.state = None

    async def close(self) -> None:
        self.pool.close()


class ShmReceive(ReceiveConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.maps = SegmentMaps()

    async def listen(self, sink: Any) -> str:
        return self.local.host_id

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

    async def close(self) -> None:
        self.maps.close()


CONNECTOR = Backend("shm", ShmSend, ShmReceive, auto_rank=0)
