"""The prefill node's shared-memory segment pool under churn: more segments live than the pool
keeps free, of different sizes, returned and taken again in any order."""

from __future__ import annotations

import os
import random

import pytest

from pdserve.common.kv.shm import SHM_DIR, SegmentMaps, SegmentPool


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


def test_the_decode_side_lets_go_of_segments_their_sender_destroyed():
    """A sender's pool destroys segments it keeps no more (here: more than one free); the
    receiver mapped each, and kept every mapping (an unlinked file's memory stays in
    /dev/shm while mapped, and names are never reused: /dev/shm filled up). It now drops
    the mappings of files gone when it maps another; and maps only its sender's segments."""
    pool, maps = SegmentPool("test-maps", max_free=1), SegmentMaps()
    try:
        segs = [pool.take(1 << 20) for _ in range(4)]
        for seg in segs:
            got = maps.get(seg.name, 1 << 20, "test-maps")
            assert got.size >= 1 << 20
            maps.done(got)  # its intake ended
        for seg in segs:
            pool.give_back(seg)  # three destroyed, one kept free
        fresh = pool.take(4 << 20)  # a size the free one cannot hold: a new segment
        maps.get(fresh.name, 4 << 20, "test-maps")
        alive = {n for n in maps.maps if os.path.exists(os.path.join(SHM_DIR, n))}
        assert set(maps.maps) == alive and len(alive) == 2
        for name in (fresh.name, "pdserve-kv-0123456789ab", "pdserve-other/../x"):
            with pytest.raises(ValueError):
                maps.get(name, 1 << 20, "other")  # not that sender's pool's
        for name, sender in (("pdserve-kv-0123456789ab", "kv"), ("pdserve-a-b-abcdef-1", "a")):
            with pytest.raises(ValueError):  # a node named "kv", or a prefix of another's name
                maps.get(name, 1 << 20, sender)
    finally:
        maps.close()
        pool.close()
