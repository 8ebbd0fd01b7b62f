"""The scheduler's prefix caching: which blocks of a waiting sequence are already computed
(here, or in a lower tier worth loading from), and registering computed blocks for reuse.

A mixin of `Scheduler` (scheduler.py), split off along that seam: admission and batching
live there, hashing and the tier store here. It reads the scheduler's config and block
manager and touches no clock or socket.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.common.engine.block_manager import BlockManager, prefix_hashes
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.tiers import TierStore

if TYPE_CHECKING:
    from pdserve.common.engine.scheduler import SchedulerConfig

log = logging.getLogger(__name__)


class PrefixCaching:
    cfg: SchedulerConfig
    block_manager: BlockManager
    tiers: TierStore | None
    _write_block: Callable[[int, bytes], None] | None

    def attach_tiers(
        self,
        tiers: TierStore,
        read_block: Callable[[int], bytes],
        write_block: Callable[[int, bytes], None],
    ) -> None:
        """Blocks about to be overwritten go to `tiers`; a prefix that continues there is
        loaded back when that is cheaper than recomputing it."""
        self.tiers, self._write_block = tiers, write_block
        self.block_manager.on_evict = lambda block, digest: tiers.put(digest, read_block(block))

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """The longest cached prefix of a waiting sequence's tokens, short of its last token
        (computed anyway: its logits are needed): blocks of this cache (not taken yet), then
        hashes a lower tier holds and would load faster than they recompute."""
        if not self.cfg.prefix_caching or seq.block_table:
            return [], []
        self._extend_hashes(seq)
        usable = seq.block_hashes[: (seq.num_tokens - 1) // self.cfg.block_size]
        hits = self.block_manager.match(usable)
        loads: list[bytes] = []
        tiers = self.tiers
        if tiers is not None and tiers.enabled:
            for digest in usable[len(hits) :]:
                tier = tiers.where(digest)
                if tier is None or not tiers.worth_loading(tier, self.cfg.block_size):
                    break
                loads.append(digest)
        return hits, loads

    def _tiers_ready(self, seq: Sequence, loads: list[bytes]) -> bool:
        """Whether loading `loads` now reads no disk here (common/engine/tier_reader.py)."""
        return self.tiers is None or self.tiers.ready(loads, seq.seq_id)

    def _release_reads(self, seq: Sequence) -> None:
        """The sequence waits no more (admitted, or ended): its disk reads ahead let go."""
        if self.tiers is not None:
            self.tiers.release(seq.seq_id)

    def _load(self, blocks: list[int], hashes: list[bytes]) -> int:
        """Fill the first blocks with the tiers' copies of `hashes`; how many it loaded (a
        block that is gone or corrupt, or a copy that fails, ends the run: the rest is
        computed; a failure raised here would leave the sequence's blocks nobody's and stop
        the step loop)."""
        tiers, write = self.tiers, self._write_block
        if not hashes or tiers is None or write is None:
            return 0
        for i, digest in enumerate(hashes):
            try:
                if not tiers.load(digest, functools.partial(write, blocks[i])):
                    return i
            except Exception:  # out of device or pinned memory, say
                log.warning("loading a cached block from the KV tiers failed", exc_info=True)
                return i
        return len(hashes)

    def _extend_hashes(self, seq: Sequence, upto: int | None = None) -> None:
        """Hash the sequence's full blocks (up to `upto` blocks) it has not hashed yet."""
        full = min(len(seq.token_ids) // self.cfg.block_size, upto if upto is not None else 1 << 62)
        have = len(seq.block_hashes)
        if full > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += prefix_hashes(
                seq.token_ids[: full * self.cfg.block_size],
                self.cfg.block_size,
                self.cfg.hash_salt,
                start=have,
                parent=parent,
            )

    def _register(self, seq: Sequence) -> None:
        """Make the full blocks whose KV is computed reusable (prefix caching)."""
        if not self.cfg.prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.cfg.block_size, len(seq.block_table))
        if full > seq.num_registered_blocks:
            self._extend_hashes(seq, full)
            first = seq.num_registered_blocks
            self.block_manager.register(seq.block_table[first:full], seq.block_hashes[first:full])
            seq.num_registered_blocks = full
