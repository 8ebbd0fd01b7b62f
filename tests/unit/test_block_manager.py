import pytest

from pdserve.common.engine.block_manager import BlockManager, prefix_hashes


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    blocks = bm.allocate(3)
    assert len(set(blocks)) == 3
    assert bm.num_in_use_blocks == 3 and bm.num_free_blocks == 5
    bm.free(blocks)
    assert bm.num_in_use_blocks == 0 and bm.num_free_blocks == 8


def test_allocate_beyond_capacity_raises_and_grow_reports_false():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(MemoryError):
        bm.allocate(3)
    table: list[int] = []
    assert bm.grow(table, 8) and len(table) == 2
    assert not bm.grow(table, 9)
    assert len(table) == 2


def test_grow_adds_blocks_only_at_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(1)
    assert bm.grow(table, 4) and len(table) == 1
    assert bm.grow(table, 5) and len(table) == 2


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(AssertionError):
        bm.free(blocks)


def test_prefix_hashes_chain_whole_prefixes():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b
    assert c[1] != a[1]  # same second block, different first block: different chain


def test_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4]
    table = bm.allocate(2)
    bm.register_full_blocks(table, tokens)
    bm.free(table)
    assert bm.num_cached_blocks == 2 and bm.num_in_use_blocks == 0
    hit = bm.match_prefix([1, 2, 3, 4, 5])
    assert hit == table
    bm.take(hit)
    assert bm.num_in_use_blocks == 2 and bm.ref_counts[hit[0]] == 1
    bm.free(hit)
    # allocating every block evicts the cached ones and forgets their hashes
    all_blocks = bm.allocate(4)
    assert sorted(all_blocks) == [0, 1, 2, 3]
    assert bm.match_prefix(tokens) == [] and bm.num_cached_blocks == 0


def test_shared_block_freed_only_when_last_reference_goes():
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate(1)
    bm.register_full_blocks(table, [7, 8])
    bm.take(bm.match_prefix([7, 8]))
    bm.free(table)
    assert bm.num_in_use_blocks == 1
    bm.free(table)
    assert bm.num_in_use_blocks == 0
