"""Blocks for KV about to arrive, reusing the prefix this node already caches. Shared by the
decode role (KV from a prefill node) and prefix fetches (KV from a peer's cache)."""

from __future__ import annotations

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.wire.kv_messages import (
    PREFIX_GONE,
)


def reserve_blocks(
    bm: BlockManager, prompt_ids: list[int], skip: int, num_tokens: int, keep_free: int
) -> list[int] | str:
    """Blocks for KV arriving for `num_tokens` tokens of which this node holds the first
    `skip` (whole blocks of its prefix cache, taken here): the block table, or why not."""
    hits = bm.match(bm.hashes(prompt_ids[:skip])) if skip else []
    if len(hits) * bm.block_size < skip:
        return f"{PREFIX_GONE}: {len(hits) * bm.block_size} of {skip} tokens here"
    need = bm.blocks_needed(num_tokens) - len(hits)
    idle = sum(1 for b in hits if bm.ref_counts[b] == 0)  # cached: in the free queue
    if not bm.can_allocate(need + idle, reserve=keep_free):
        return f"needs {need} KV blocks, {bm.num_free_blocks} free"
    bm.take(hits)
    return [*hits, *bm.allocate(need)]
