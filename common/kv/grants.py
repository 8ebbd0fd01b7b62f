"""Write grants into another process's KV cache, safe against late and dead writers.

The one-copy same-host path (shm_direct.py) lets a prefill node write KV straight into the
blocks a decode node reserved. The danger is a write that lands after the decode node gave
those blocks back (a refused, timed-out or aborted transfer): it would overwrite another
sequence's KV. Grants rule that out without trusting timing:

- The decode node owns a small file in /dev/shm: one 64-bit slot per ticket. To let a peer
  write into a reservation it takes a free ticket, stores a fresh random nonce in its slot
  and sends (ticket, nonce, block table) to the writer (`KvGrant`).
- The writer, for each layer: takes an exclusive lock on the ticket's byte of that file,
  checks the slot still holds its nonce, copies the layer, unlocks; only then tells the
  decode node the layer landed.
- The decode node gives blocks back only after revoking the ticket: it zeroes the slot (no
  writer passes its check from then on), then takes the same lock without waiting to make
  sure none is inside: a writer in the middle of a layer holds it, so the blocks stay
  quarantined and the intake tries again on its next tick. Only then is the ticket free.

The locks are open-file-description locks (common/ofd.py): the kernel drops them when the
holder dies, so a crashed writer never pins a reservation.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from pdserve.common.ofd import (
    GRANT_FILE_PREFIX,
    SHM_DIR,
    grant_owner_byte,
    lock_byte,
    sweep_dead_kv_files,
    unlock_byte,
)

PREFIX = GRANT_FILE_PREFIX


class GrantTable:
    """Decode side: tickets for writers into this node's shared KV cache."""

    def __init__(self, capacity: int = 4096) -> None:
        sweep_dead_kv_files()  # those of decode nodes killed before they removed theirs
        name = secrets.token_hex(6)
        self.path = os.path.join(SHM_DIR, PREFIX + name)
        self.capacity = capacity
        # made and locked (its owner's byte, held while this table lives) under another
        # name, then renamed: a sweep at the same moment never sees it unlocked
        draft = os.path.join(SHM_DIR, f"pdserve-grantdraft-{name}")
        self.fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, capacity * 8)
            if not lock_byte(self.fd, grant_owner_byte(capacity * 8)):
                raise OSError(f"cannot lock {draft}")
            os.rename(draft, self.path)
        except BaseException:
            os.close(self.fd)
            os.unlink(draft)
            raise
        self._mem = mmap.mmap(self.fd, capacity * 8)
        self.slots = np.frombuffer(self._mem, dtype=np.uint64)
        self.free = deque(range(capacity))  # FIFO: a ticket rests long before its reuse
        self.out: set[int] = set()

    def grant(self) -> tuple[int, int] | None:
        """A ticket and its nonce; None when every ticket is out."""
        if not self.free:
            return None
        ticket, nonce = self.free.popleft(), secrets.randbits(63) | 1  # never 0 (revoked)
        self.slots[ticket] = nonce
        self.out.add(ticket)
        return ticket, nonce

    def revoke(self, ticket: int) -> bool:
        """Close the ticket (no write starts after this call); False while a writer is still
        inside it: call again later, the ticket stays out until then."""
        self.slots[ticket] = 0
        if not lock_byte(self.fd, ticket):
            return False
        unlock_byte(self.fd, ticket)
        if ticket in self.out:
            self.out.discard(ticket)
            self.free.append(ticket)
        return True

    @property
    def outstanding(self) -> int:
        return self.capacity - len(self.free)

    def close(self, wait: float = 5.0) -> int:
        """Revoke every ticket still out (waiting up to `wait` s for writers inside a layer:
        the cache may be handed on, e.g. to the node's next role), then remove the file.
        The tickets a writer still held at the end: 0 unless one hung."""
        deadline = time.monotonic() + wait
        while self.out:
            for ticket in list(self.out):
                self.revoke(ticket)
            if not self.out or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        left = len(self.out)
        del self.slots
        self._mem.close()
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return left


class GrantView:
    """Writer side: the decode node's grant file, opened by this process."""

    def __init__(self, path: str) -> None:
        if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise ValueError(f"refusing grant file {path!r}")
        self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        weakref.finalize(self, os.close, self.fd)  # its locks go with it
        size = os.fstat(self.fd).st_size
        self._mem = mmap.mmap(self.fd, size)
        self.slots = np.frombuffer(self._mem, dtype=np.uint64)
        # OFD locks taken through one descriptor do not exclude each other: threads of this
        # process writing through this view take turns here first
        self.mutex = threading.Lock()

    @contextmanager
    def hold(self, ticket: int, nonce: int) -> Iterator[bool]:
        """Inside: whether the grant is still open; while inside, it cannot be revoked."""
        if not 0 <= ticket < len(self.slots):
            yield False
            return
        with self.mutex:
            lock_byte(self.fd, ticket, wait=True)
            try:
                yield int(self.slots[ticket]) == nonce
            finally:
                unlock_byte(self.fd, ticket)
