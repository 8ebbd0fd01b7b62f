"""KV block bookkeeping: free queue, reference counts, chained prefix hashes. Pure Python.

A block is `in_use` (ref count > 0), `cached` (ref count 0 but holding a full block whose
prefix hash is registered, reusable by a later request with the same prefix) or `free`.
Freed blocks join the tail of one queue and allocation takes from the head, so cached
blocks are evicted least recently freed first (vLLM v1's free-block queue). A full block's
hash chains its parent's hash with its tokens, so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # -- queries -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free or cached)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for b in self.free_queue if self.hash_of[b] is not None)

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_in_use_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= len(self.free_queue)

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise MemoryError(f"need {num_blocks} KV blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self.free_queue.popitem(last=False)
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

    # -- prefix reuse --------------------------------------------------------------------
    def register_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int]) -> None:
        """Record the hashes of the full blocks of a sequence whose KV is computed."""
        for block, digest in zip(
            block_table, prefix_hashes(token_ids, self.block_size), strict=False
        ):
            if self.hash_of[block] is None and digest not in self.block_of_hash:
                self.hash_of[block] = digest
                self.block_of_hash[digest] = block

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of `token_ids` (not yet taken)."""
        blocks = []
        for digest in prefix_hashes(token_ids, self.block_size):
            block = self.block_of_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, blocks: Sequence[int]) -> None:
        """Add a reference to blocks found by `match_prefix`."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        digest = self.hash_of[block]
        if digest is not None:
            self.hash_of[block] = None
            if self.block_of_hash.get(digest) == block:
                del self.block_of_hash[digest]
