"""Chained prefix hashes of KV blocks, shared by the engine's block manager (what it caches)
and the gateway (which node holds a request's prefix). Pure: no torch.

A full block's hash chains its parent's hash with its tokens, from a root `salt` (model,
dtype, block size: KV of another model or precision must never match), so equal hashes mean
equal whole prefixes of equal KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


def hash_salt(model_id: str, dtype: str, block_size: int) -> bytes:
    """The root of every chain: prefixes of different models or KV precisions never match."""
    return hashlib.blake2b(f"{model_id}|{dtype}|{block_size}".encode(), digest_size=16).digest()


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes = b"", start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:  # fmt: skip
    """Chained hashes of every full block of `token_ids` from block `start` on (`parent`: the
    hash of block start - 1, so a sequence's hashes extend without rehashing its prefix)."""
    hashes: list[bytes] = []
    if start == 0:
        parent = salt or None
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


def token_ids_problem(ids: list[int], vocab_size: int) -> str | None:
    """A token id outside the vocabulary, said (an offer, a KV header, a fetch): one past
    2**63 fails its packing in the prefix hashes, the engine's embedding on any other."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return f"a token id outside the vocabulary (0 to {vocab_size - 1})"
    return None
