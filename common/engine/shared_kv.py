"""A KV cache tensor that lives in shared memory, so a prefill node on the same host can write
a request's KV straight into the blocks this node reserved (one copy instead of two: the
shm_direct KV backend, common/kv/shm_direct.py).

The cache is a file in /dev/shm mapped by its owner (the tensor's storage) and by writers.
Its owner holds an open-file-description lock on byte 0 for its whole life; a file whose
lock anyone else can take belongs to a dead process, and the next node to start removes it
(a crash leaves no multi-GB file behind for long). `auto` shares the cache only on CPU and
only when /dev/shm has room for it beside a margin for the segment-based shm backend.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
from dataclasses import dataclass

import torch

from pdserve.common.ofd import KV_FILE_PREFIX, SHM_DIR, lock_byte, sweep_dead_kv_files

log = logging.getLogger(__name__)

PREFIX = KV_FILE_PREFIX
MARGIN = 256 << 20  # /dev/shm kept free for the shm backend's segments


@dataclass
class SharedFile:
    """The owner's side of a shared cache file."""

    path: str
    size: int
    fd: int
    mem: mmap.mmap

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # drops the owner lock; the mapping lives while the tensor does


def fits(size: int, margin: int = MARGIN) -> bool:
    """Whether /dev/shm has room for `size` bytes and `margin` (a tmpfs that runs out while
    pages are touched kills the process with SIGBUS: check first)."""
    sweep_dead_kv_files()  # a killed predecessor's cache counted against its successor
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= size + margin


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedFile]:
    """A zeroed tensor of `shape` whose storage is a new file in /dev/shm (pages touched now,
    not mid-run, as torch.zeros would)."""
    sweep_dead_kv_files()  # files whose owner died (nobody holds their lock)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    name = secrets.token_hex(6)
    # made and locked under another name, then renamed: a sweep by a node starting at the
    # same moment never sees it unlocked
    draft = os.path.join(SHM_DIR, f"pdserve-kvdraft-{name}")
    path = os.path.join(SHM_DIR, PREFIX + name)
    fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not lock_byte(fd, 0):
            raise OSError(f"cannot lock {draft}")
        # the pages reserved now: a /dev/shm another node filled meanwhile (both passed the
        # free-space check) is an OSError here, not a SIGBUS in the middle of zeroing
        if hasattr(os, "posix_fallocate"):  # Linux; elsewhere a size only
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        mem = mmap.mmap(fd, size)
        os.rename(draft, path)
    except BaseException:
        os.close(fd)
        os.unlink(draft)
        raise
    tensor = torch.frombuffer(mem, dtype=dtype).view(shape)
    tensor.zero_()
    log.info("KV cache in shared memory: %s (%.1f MiB)", path, size / 2**20)
    return tensor, SharedFile(path, size, fd, mem)


def map_cache(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A writer's view of another node's shared cache (checked against the expected size)."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"refusing KV cache file {path!r}")
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path} is not a cache of shape {shape} {dtype}")
        mem = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mem, dtype=dtype).view(shape)
