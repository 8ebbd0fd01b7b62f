"""The prefill node's shared-memory segment pool under churn: more segments live than the pool
keeps free, of different sizes, returned and taken again in any order."""

from __future__ import annotations

import os
import random

from pdserve.common.kv.shm import SHM_DIR, SegmentPool


def test_segments_never_reuse_a_live_name_under_churn():
    pool = SegmentPool("test-churn", max_free=2)
    rng = random.Random(0)
    live = []
    try:
        for _ in range(400):
            if live and rng.random() < 0.45:
                pool.give_back(live.pop(rng.randrange(len(live))))
            else:  # sizes 1-8 MiB: destroyed segments are the smallest, not the newest
                live.append(pool.take(rng.randint(1, 8) << 20))
            names = [s.name for s in live]
            assert len(set(names)) == len(names)
            assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
        assert len(pool.free) <= 2
    finally:
        for seg in live:
            pool.give_back(seg)
        pool.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(pool.prefix)]
