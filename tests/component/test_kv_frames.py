"""The KV frame in parts: views of the paged cache that go out without a copy, and imports
of a frame in any number of parts into consecutive or scattered blocks. Every path must put
exactly the same bytes where the one-buffer frame would."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.engine.staging import Staged

LAYERS, HEADS, DIM, BS = 2, 3, 8, 4


def _cache(num_blocks: int = 40, fill: bool = False) -> KVCache:
    cache = KVCache(LAYERS, num_blocks, BS, HEADS, DIM, torch.float32)
    if fill:
        cache.data.normal_()
    return cache


def _tables(n: int) -> dict[str, list[int]]:
    need = -(-n // BS)
    rng = random.Random(n)
    shuffled = rng.sample(range(40), need)
    return {
        "consecutive": list(range(3, 3 + need)),
        "reversed": list(range(need))[::-1],
        "shuffled": shuffled,
        "two-runs": [*range(20, 20 + need // 2), *range(5, 5 + need - need // 2)],
    }


@pytest.mark.parametrize("n", [1, 4, 13, 37])
def test_parts_round_trip_into_any_blocks(n):
    src = _cache(fill=True)
    for src_kind, src_table in _tables(n).items():
        frames = [src.export_frame(layer, src_table, n) for layer in range(LAYERS)]
        for dst_kind, dst_table in _tables(n).items():
            for how in ("parts", "whole", "split"):
                dst = _cache()
                for layer in range(LAYERS):
                    if how == "parts":
                        payload = src.export_parts(layer, src_table, n)
                    elif how == "whole":
                        payload = frames[layer]
                    else:  # arbitrary cut points, as a transport might deliver
                        raw = bytes(frames[layer])
                        cuts = sorted(random.Random(layer).sample(range(1, len(raw)), 3))
                        edges = zip([0, *cuts], [*cuts, len(raw)], strict=True)
                        payload = [raw[a:b] for a, b in edges]
                    dst.import_kv(layer, dst_table, n, payload)
                for layer in range(LAYERS):
                    got = bytes(dst.export_frame(layer, dst_table, n))
                    assert got == bytes(frames[layer]), (src_kind, dst_kind, how, layer)


def test_consecutive_blocks_export_as_two_views_of_the_cache():
    cache = _cache(fill=True)
    parts = cache.export_parts(1, [7, 8, 9], 10)
    assert len(parts) == 2  # K and V, no gather
    base = cache.data.data_ptr()
    addresses = [np.frombuffer(p, dtype=np.uint8).ctypes.data for p in parts]
    slot_bytes = HEADS * DIM * 4
    layer_bytes = 2 * cache.num_blocks * BS * slot_bytes
    k_at = base + layer_bytes + 7 * BS * slot_bytes
    v_at = k_at + cache.num_blocks * BS * slot_bytes
    assert addresses == [k_at, v_at]  # the cache's own memory
    assert [len(p) for p in parts] == [10 * slot_bytes] * 2


def test_fragmented_tables_fall_back_to_one_gathered_frame():
    cache = _cache(fill=True)
    table = list(range(0, 40, 2))  # 20 separate blocks: 40 parts
    parts = cache.export_parts(0, table, 80, max_parts=32)
    assert len(parts) == 1 and isinstance(parts[0], Staged)  # the sender waits, then sends
    assert bytes(parts[0].bytes()) == bytes(cache.export_frame(0, table, 80))


def test_a_frame_of_the_wrong_size_is_refused():
    cache = _cache()
    good = _cache(fill=True).export_frame(0, [0, 1], 8)
    with pytest.raises(ValueError, match="KV frame of"):
        cache.import_kv(0, [0, 1], 8, [bytes(good)[:-4]])


def test_decode_attention_gathers_whole_blocks_as_the_slots_they_hold():
    """gather_blocks (the decode step's read of block tables, head-major) holds, position by
    position, what the token-by-token gather reads at the same slots."""
    cache = _cache(fill=True)
    tables = torch.tensor([[7, 2, 30], [0, 39, 5], [11, 12, 13]])  # (B, nb)
    pos = torch.arange(3 * BS)
    slots = tables[:, pos // BS] * BS + pos % BS  # (B, L)
    for layer in range(LAYERS):
        k, v = cache.gather_blocks(layer, tables)
        k_ref, v_ref = cache.gather(layer, slots)  # (B, L, heads, dim)
        assert k.is_contiguous() and k.shape == (3, HEADS, 3 * BS, DIM)
        assert torch.equal(k, k_ref.transpose(1, 2)) and torch.equal(v, v_ref.transpose(1, 2))
