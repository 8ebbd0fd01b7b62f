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
- The decode node gives blocks back only after revoking the ticket: the same lock taken
  without waiting (a writer in the middle of a layer holds it: the blocks stay quarantined
  and the intake tries again on its next tick), the slot zeroed, the lock released. After
  that no writer can pass its check.

The locks are open-file-description locks (common/ofd.py): the kernel drops them when the
holder dies, so a crashed writer never pins a reservation.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from pdserve.common.ofd import lock_byte, unlock_byte

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-grants-"


class GrantTable:
    """Decode side: tickets for writers into this node's shared KV cache."""

    def __init__(self, capacity: int = 4096) -> None:
        self.path = os.path.join(SHM_DIR, PREFIX + secrets.token_hex(6))
        self.capacity = capacity
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, capacity * 8)
        self._mem = mmap.mmap(self.fd, capacity * 8)
        self.slots = np.frombuffer(self._mem, dtype=np.uint64)
        self.free = list(range(capacity - 1, -1, -1))

    def grant(self) -> tuple[int, int] | None:
        """A ticket and its nonce; None when every ticket is out."""
        if not self.free:
            return None
        ticket, nonce = self.free.pop(), secrets.randbits(63) | 1  # never 0 (revoked)
        self.slots[ticket] = nonce
        return ticket, nonce

    def revoke(self, ticket: int) -> bool:
        """Close the ticket; False while a writer is inside it (try again later)."""
        if not lock_byte(self.fd, ticket):
            return False
        try:
            self.slots[ticket] = 0
        finally:
            unlock_byte(self.fd, ticket)
        self.free.append(ticket)
        return True

    @property
    def outstanding(self) -> int:
        return self.capacity - len(self.free)

    def close(self) -> None:
        del self.slots
        self._mem.close()
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class GrantView:
    """Writer side: the decode node's grant file, opened by this process."""

    def __init__(self, path: str) -> None:
        if not os.path.basename(path).startswith(PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise ValueError(f"refusing grant file {path!r}")
        self.fd = os.open(path, os.O_RDWR)
        size = os.fstat(self.fd).st_size
        self._mem = mmap.mmap(self.fd, size)
        self.slots = np.frombuffer(self._mem, dtype=np.uint64)

    @contextmanager
    def hold(self, ticket: int, nonce: int) -> Iterator[bool]:
        """Inside: whether the grant is still open; while inside, it cannot be revoked."""
        if not 0 <= ticket < len(self.slots):
            yield False
            return
        lock_byte(self.fd, ticket, wait=True)
        try:
            yield int(self.slots[ticket]) == nonce
        finally:
            unlock_byte(self.fd, ticket)

    def close(self) -> None:
        del self.slots
        self._mem.close()
        os.close(self.fd)
