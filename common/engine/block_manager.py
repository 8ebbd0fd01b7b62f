"""KV block bookkeeping: free queue, reference counts, chained prefix hashes. Pure Python.

A block is `in_use` (ref count > 0), `cached` (ref count 0 but holding a full block whose
prefix hash is registered, reusable by a later request with the same prefix) or `free`.
Freed blocks join the tail of one queue and allocation takes from the head, so cached
blocks are evicted least recently freed first (vLLM v1's free-block queue). A full block's
hash chains its parent's hash with its tokens, from a root `salt` (model, dtype, block size:
KV of another model or precision must never match), so equal hashes mean equal whole
prefixes of equal KV.

With `record_events`, every hash registered (`stored`) or forgotten because its block was
taken for other tokens (`evicted`) is queued for the node to publish (the gateway's prefix
index, common/wire/protocol.py KvEvents). The queue is bounded: past `MAX_EVENTS` it is dropped
and `events_lost` tells the node to publish a full snapshot instead.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.common.prefix import block_hash, hash_salt, prefix_hashes

log = logging.getLogger(__name__)

__all__ = ["MAX_EVENTS", "BlockManager", "block_hash", "hash_salt", "prefix_hashes"]

MAX_EVENTS = 8192


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, salt: bytes = b"", record_events: bool = False
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # blocks in the free queue holding a registered hash, kept as they move: a count over
        # the queue cost ~0.7 ms a load report with 10^4-10^5 blocks, one per gateway a beat
        self._cached = 0
        self.record_events = record_events
        self.events: list[tuple[bool, bytes]] = []  # (stored?, hash), in order
        self.events_lost = False
        # called with (block, hash) just before a cached block's KV is overwritten: the
        # last moment to keep it elsewhere (a lower tier)
        self.on_evict: Callable[[int, bytes], None] | None = None

    # -- queries -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free or cached)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return self._cached

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_in_use_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= len(self.free_queue)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return prefix_hashes(token_ids, self.block_size, self.salt)

    def cached_hashes(self) -> list[bytes]:
        """Every hash this cache can serve (in use or cached): a snapshot for the index."""
        return list(self.block_of_hash)

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise MemoryError(f"need {num_blocks} KV blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self.free_queue.popitem(last=False)
            if self.hash_of[block] is not None:
                self._cached -= 1
            self._forget_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend `block_table` in place to hold `num_tokens`; False if blocks ran out."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        if extra <= 0:
            return True
        if extra > len(self.free_queue):
            return False
        block_table.extend(self.allocate(extra))
        return True

    def free(self, block_table: Sequence[int]) -> None:
        # Reverse order: a sequence's tail blocks are evicted before its shared prefix.
        for block in reversed(block_table):
            assert self.ref_counts[block] > 0, f"double free of KV block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.hash_of[block] is not None:
                    self._cached += 1

    # -- prefix reuse --------------------------------------------------------------------
    def register(self, block_table: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Full blocks now hold the KV of the prefixes `hashes` (block i, hash i)."""
        for block, digest in zip(block_table, hashes, strict=False):
            if self.hash_of[block] is None and digest not in self.block_of_hash:
                self.hash_of[block] = digest
                self.block_of_hash[digest] = block
                if self.ref_counts[block] == 0:  # a free block (never, from a sequence's table)
                    self._cached += 1
                self._event(True, digest)

    def register_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int]) -> None:
        """Record the hashes of the full blocks of a sequence whose KV is computed."""
        self.register(block_table, self.hashes(token_ids))

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (not yet taken)."""
        blocks = []
        for digest in hashes:
            block = self.block_of_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        return self.match(self.hashes(token_ids))

    def take(self, blocks: Sequence[int]) -> None:
        """Add a reference to blocks found by `match`."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
                if self.hash_of[block] is not None:
                    self._cached -= 1
            self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        digest = self.hash_of[block]
        if digest is not None:
            if self.on_evict is not None:
                # a copy into a lower tier failing (disk full, a device error) loses that
                # copy, never the block's accounting (it left the free queue already)
                try:
                    self.on_evict(block, digest)
                except Exception:
                    log.exception("evicting block %d to a KV tier failed", block)
            self.hash_of[block] = None
            if self.block_of_hash.get(digest) == block:
                del self.block_of_hash[digest]
                self._event(False, digest)

    def _event(self, stored: bool, digest: bytes) -> None:
        if not self.record_events or self.events_lost:
            return
        if len(self.events) >= MAX_EVENTS:
            self.events.clear()
            self.events_lost = True  # the node sends a snapshot instead
            return
        self.events.append((stored, digest))

    def take_events(self) -> tuple[list[tuple[bool, bytes]], bool]:
        """The queued events and whether some were lost (then: publish a snapshot)."""
        events, lost = self.events, self.events_lost
        self.events, self.events_lost = [], False
        return events, lost
