import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "hit", "late"]), st.integers(0, 5), st.integers(1, 4)
        ),
        max_size=80,
    )
)
def test_reference_counts_hashes_and_lru_eviction_stay_consistent(ops):
    """Random sequences allocate, register, free and reuse prefixes of 6 distinct prompts;
    after every step: free blocks are exactly those without references, hashes point both
    ways, the cached-block count (kept as blocks move) is the count over the free queue,
    and what the cache serves for a prompt is its own chain."""
    bm = BlockManager(num_blocks=12, block_size=2, salt=b"s", record_events=True)
    prompts = [[p * 100 + i for i in range(8)] for p in range(6)]
    held: list[list[int]] = []
    freed: list[int] = []  # blocks in the order they went back to the free queue
    for op, p, n in ops:
        hashes = bm.hashes(prompts[p])[:n]
        if op == "alloc" and bm.can_allocate(n):
            table = bm.allocate(n)
            bm.register(table, hashes)
            held.append(table)
        elif op == "hit":
            hit = bm.match(hashes)
            bm.take(hit)
            held.append(hit)
        elif op == "free" and held:
            table = held.pop(p % len(held))
            bm.free(table)
            freed += [b for b in reversed(table) if bm.ref_counts[b] == 0]
        elif op == "late":  # a hash registered on a block already free
            bare = [b for b in bm.free_queue if bm.hash_of[b] is None]
            if bare:
                bm.register([bare[p % len(bare)]], [b"late-%d-%d" % (p, n)])
        assert bm.num_cached_blocks == sum(bm.hash_of[b] is not None for b in bm.free_queue)
        assert set(bm.free_queue) == {b for b in range(12) if bm.ref_counts[b] == 0}
        assert all(bm.hash_of[b] == h for h, b in bm.block_of_hash.items())
        for q, prompt in enumerate(prompts):  # a match is a chain of that prompt's blocks
            hit = bm.match(bm.hashes(prompt))
            assert [bm.hash_of[b] for b in hit] == bm.hashes(prompt)[: len(hit)], q
    queue = list(bm.free_queue)  # least recently freed first: the eviction order
    order = [b for b in dict.fromkeys(reversed(freed)) if b in bm.free_queue][::-1]
    assert queue[-len(order) :] == order if order else True
    events, lost = bm.take_events()
    stored = {h for s, h in events if s}
    assert lost or set(bm.block_of_hash) <= stored


def test_events_record_stored_and_evicted_hashes_and_overflow_asks_for_a_snapshot():
    from pdserve.common.engine import block_manager as bm_module

    bm = BlockManager(num_blocks=2, block_size=2, salt=b"s", record_events=True)
    table = bm.allocate(2)
    hashes = bm.hashes([1, 2, 3, 4])
    bm.register(table, hashes)
    bm.free(table)
    bm.allocate(2)  # takes both cached blocks for other tokens
    events, lost = bm.take_events()
    assert events == [(True, hashes[0]), (True, hashes[1]), (False, hashes[1]), (False, hashes[0])]
    assert not lost
    for i in range(bm_module.MAX_EVENTS + 1):
        bm._event(True, bytes([i % 256]) * 16)
    events, lost = bm.take_events()
    assert lost and not events


def test_a_failing_tier_copy_at_eviction_leaks_nothing():
    """The eviction hook copies a cached block to a lower tier; when it raised (disk full, a
    device error), the blocks popped so far in that allocation belonged to no table for good
    and the failing one stayed findable by its hash while out of the free queue."""
    bm = BlockManager(num_blocks=2, block_size=4)
    tokens = list(range(8))
    cached = bm.allocate(2)
    bm.register_full_blocks(cached, tokens)
    bm.free(cached)  # both cached, both free

    def evict(block: int, digest: bytes) -> None:
        raise OSError("no space left on device")

    bm.on_evict = evict
    taken = bm.allocate(2)  # evicts both: each copy fails
    assert bm.num_in_use_blocks == 2 and sorted(taken) == sorted(cached)
    assert bm.match_prefix(tokens) == []  # nothing findable by a hash it no longer holds
    bm.free(taken)
    assert bm.num_free_blocks == 2 and bm.num_in_use_blocks == 0
