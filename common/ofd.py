"""Linux open-file-description locks on single bytes of a file (F_OFD_SETLK).

Unlike classic POSIX record locks they conflict between any two opens of a file, threads of
one process included, and survive the closing of other descriptors of the same file; like
them, the kernel drops a lock when its holder dies. Used to guard writes into shared KV
caches (common/kv/grants.py) and to tell a live cache file or shm segment from an orphan
(common/engine/shared_kv.py, common/kv/shm.py)."""

from __future__ import annotations

import fcntl
import os
import struct

# struct flock on Linux (x86-64, arm64): l_type, l_whence, l_start, l_len, l_pid (0 for OFD)
_FLOCK = "hhxxxxqqixxxx"


def lock_byte(fd: int, byte: int, wait: bool = False) -> bool:
    """Lock byte `byte` of the file exclusively; False if another open holds it (no wait)."""
    return _set(fd, byte, fcntl.F_WRLCK, wait)


def unlock_byte(fd: int, byte: int) -> None:
    _set(fd, byte, fcntl.F_UNLCK, False)


def _set(fd: int, byte: int, kind: int, wait: bool) -> bool:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, byte, 1, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


SHM_DIR = "/dev/shm"
KV_FILE_PREFIX = "pdserve-kv-"  # a node's KV cache in shared memory (common/engine/shared_kv.py)
# a decode node's write grants (common/kv/grants.py): one 8-byte slot per ticket, the byte
# after the last slot its owner's lock (the slots' bytes are the writers')
GRANT_FILE_PREFIX = "pdserve-grants-"
# the shm backend's segments (common/kv/shm.py): POOL-N, and POOL + SEG_OWNER_SUFFIX, the
# file whose byte 0 the pool's owner locks. A prefix no other kind's name can start with (a
# node named "kv-1" had its live segments swept as dead KV cache files)
SEG_FILE_PREFIX = "pdserve-seg-"
SEG_OWNER_SUFFIX = "-owner"
SWEPT = (KV_FILE_PREFIX, GRANT_FILE_PREFIX, SEG_FILE_PREFIX)


def grant_owner_byte(size: int) -> int:
    return size // 8


def sweep_dead_kv_files() -> int:
    """Remove KV cache, grant and shm segment files whose owner died (nobody holds its
    lock): how many. Torch-free, for `pdserve up` after its children stop (a child killed
    before its finalizer ran leaves a file of its whole KV cache, a GiB by default, its grant
    file and its segments)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SWEPT)]
    except OSError:
        return 0
    dead: dict[str, bool] = {}  # lock file -> nobody holds it
    removed = 0
    # a pool's segments before its owner file: a segment whose owner file is gone is dead
    for name in sorted(names, key=lambda n: n.endswith(SEG_OWNER_SUFFIX)):
        owner = _owner_of(name)
        if owner not in dead:
            dead[owner] = _unowned(owner)
        if dead[owner]:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def _owner_of(name: str) -> str:
    """The file whose lock says whether `name`'s owner lives."""
    if not name.startswith(SEG_FILE_PREFIX) or name.endswith(SEG_OWNER_SUFFIX):
        return name
    return name.rsplit("-", 1)[0] + SEG_OWNER_SUFFIX


def _unowned(name: str) -> bool:
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:  # a segment's pool is gone (its segments outlived it)
        return True
    except OSError:
        return False
    try:
        owner = 0
        if name.startswith(GRANT_FILE_PREFIX):
            owner = grant_owner_byte(os.fstat(fd).st_size)
        return lock_byte(fd, owner)
    except OSError:
        return False
    finally:
        os.close(fd)
