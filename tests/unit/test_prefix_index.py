"""The gateway's prefix index: per node, the block hashes its cache holds, kept from events
in order; a gap makes the node's entry stale (counted as holding nothing) until a snapshot."""

from __future__ import annotations

from pdserve.common.engine.block_manager import prefix_hashes
from pdserve.common.wire.protocol import KvEvents
from pdserve.gateway.prefix_index import PrefixIndex

H = prefix_hashes(list(range(64)), 16, b"salt")  # 4 chained blocks


def ev(seq: int, stored=(), evicted=(), snapshot=False) -> KvEvents:
    return KvEvents(
        node_id="n", seq=seq, stored=list(stored), evicted=list(evicted), snapshot=snapshot
    )


def test_events_in_order_track_what_the_node_holds():
    index = PrefixIndex()
    assert index.apply(ev(0, stored=H[:3], snapshot=True))
    assert index.cached_blocks("n", H) == 3
    assert index.apply(ev(1, evicted=[H[1]]))
    assert index.cached_blocks("n", H) == 1  # the chain breaks at the evicted block
    assert index.apply(ev(2, stored=[H[1], H[3]]))
    assert index.cached_blocks("n", H) == 4 and index.holders(H) == {"n": 4}


def test_a_lost_batch_makes_the_entry_stale_until_a_snapshot():
    index = PrefixIndex()
    index.apply(ev(0, stored=H, snapshot=True))
    assert not index.apply(ev(2, stored=[]))  # seq 1 never came
    assert index.needs_snapshot("n") and index.cached_blocks("n", H) == 0
    assert not index.apply(ev(3, stored=H))  # still stale: only a snapshot fixes it
    assert index.apply(ev(4, stored=H[:2], snapshot=True))
    assert not index.needs_snapshot("n") and index.cached_blocks("n", H) == 2


def test_a_node_that_leaves_or_registers_again_is_forgotten():
    index = PrefixIndex()
    index.apply(ev(0, stored=H, snapshot=True))
    index.drop("n")
    assert index.cached_blocks("n", H) == 0 and index.holders(H) == {}


def test_a_lost_last_batch_shows_in_the_next_heartbeat():
    index = PrefixIndex()
    index.apply(ev(0, stored=H, snapshot=True))
    index.check("n", 0)  # the node last sent seq 0: we have it
    assert not index.needs_snapshot("n")
    index.check("n", 1)  # it sent seq 1, which never came
    assert index.needs_snapshot("n") and index.cached_blocks("n", H) == 0
