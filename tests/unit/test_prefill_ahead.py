"""One batch ahead (--prefill-ahead on): an on-demand prefill node accepts the next batch
while a pass runs, bounded by the same limits (common/engine/scheduler.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import offer, prefill_scheduler, run_step


def _mid_pass(sched):
    """The engine computing a pass: scheduled, not done."""
    out = sched.schedule()
    assert out.prefills and all(s in sched.running for s, _ in out.prefills)
    return out


def _end_pass(sched, out) -> None:
    sched.on_step_done(out, [7] * len(out.prefills))


def test_a_prompt_offered_mid_pass_joins_the_next_pass_and_nothing_more() -> None:
    for ahead in (False, True):
        sched = prefill_scheduler(max_num_seqs=2, max_batch_tokens=100, num_blocks=50,
                                  block_size=16, ahead=ahead)  # fmt: skip
        assert offer(sched, "a", 60) is None and offer(sched, "b", 30) is None
        running = _mid_pass(sched)
        if not ahead:  # the pass fills the batch: nothing until it ends
            assert "batch full" in offer(sched, "c", 10)
            continue
        # the next batch forms now, under the same limits: two sequences, 100 tokens
        assert offer(sched, "c", 70) is None
        assert "token budget" in offer(sched, "d", 40)
        assert offer(sched, "e", 30) is None
        assert "batch full" in offer(sched, "f", 1)
        assert sched.room(False) == 0
        _end_pass(sched, running)
        # in order: the prompts accepted mid-pass are the next pass, whole
        assert [(s.seq_id, n) for s, n in run_step(sched).prefills] == [("c", 70), ("e", 30)]


def test_ahead_never_promises_kv_the_cache_lacks() -> None:
    sched = prefill_scheduler(max_num_seqs=4, max_batch_tokens=1000, num_blocks=8,
                              block_size=16, ahead=True)  # fmt: skip
    assert offer(sched, "a", 64) is None  # 4 blocks
    running = _mid_pass(sched)
    assert offer(sched, "b", 48) is None  # 3 more: 7 of 8
    assert "KV cache full" in offer(sched, "c", 32)
    _end_pass(sched, running)
    assert "KV cache full" in offer(sched, "c", 32)  # a's blocks stay until handed off
    assert sched.release("a") is not None
    assert offer(sched, "c", 32) is None


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), max_size=8),
    st.integers(1, 400),
    st.integers(1, 6),
    st.booleans(),
)
def test_room_is_exactly_what_can_take_accepts_mid_pass(taken, n, max_seqs, mid) -> None:
    """The gateway trusts a Reject's room (gateway/placement.py): with `ahead` too, `room`
    is exactly the longest prompt `can_take` accepts, mid-pass or between passes."""
    sched = prefill_scheduler(max_num_seqs=max_seqs, max_batch_tokens=500, num_blocks=40,
                              ahead=True)  # fmt: skip
    for i, m in enumerate(taken):
        offer(sched, f"r{i}", m)
    if mid and sched.waiting:
        _mid_pass(sched)
    room = sched.room(False)
    assert (sched.can_take(n, False) is None) == (n <= room)
    assert len(sched.waiting) <= max_seqs  # the next batch within the batch limit
    assert len(sched.waiting) <= 1 or sum(s.num_tokens for s in sched.waiting) <= 500
