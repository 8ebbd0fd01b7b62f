"""On-demand prefill nodes: shortest first, several prompts per pass only up to
`pass_tokens`, and no prompt overtaken for more than its own length (pass_order.py)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import make_request, offer, prefill_scheduler, run_step


def ran(sched) -> list[str]:
    return [s.seq_id for s, _ in run_step(sched).prefills]


def test_shortest_first_and_several_per_pass_only_while_short():
    sched = prefill_scheduler(max_batch_tokens=500, num_blocks=200, pass_tokens=100)
    for rid, n in [("a", 80), ("b", 30), ("c", 20), ("d", 60), ("e", 250)]:
        assert offer(sched, rid, n) is None
    assert ran(sched) == ["c", "b"]  # 50 tokens; d would make 110
    assert ran(sched) == ["d"]
    assert ran(sched) == ["a"]
    assert ran(sched) == ["e"]  # longer than pass_tokens: alone, not refused
    assert not sched.waiting


def test_off_keeps_arrival_order_and_batches_to_the_token_budget():
    sched = prefill_scheduler(max_batch_tokens=400, num_blocks=200, pass_tokens=0)
    for rid, n in [("a", 80), ("b", 30), ("c", 20), ("d", 60)]:
        assert offer(sched, rid, n) is None
    assert ran(sched) == ["a", "b", "c", "d"]


def test_a_long_prompt_goes_first_once_shorter_later_ones_took_its_length():
    sched = prefill_scheduler(max_num_seqs=4, max_batch_tokens=400, num_blocks=200,
                              pass_tokens=40)  # fmt: skip
    assert offer(sched, "long", 100) is None
    order = []
    for i in range(10):  # one 30-token prompt arrives before every pass
        assert offer(sched, f"s{i}", 30) is None
        order += ran(sched)
        if "long" in order:
            break
    # overtaken by s0..s3 (120 tokens >= 100), then first even though s4 is shorter
    assert order == ["s0", "s1", "s2", "s3", "long"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.integers(0, 2)), min_size=1, max_size=40),
       st.integers(0, 150))  # fmt: skip
def test_nothing_is_overtaken_for_more_than_its_length_and_a_pass(arrivals, pass_tokens):
    """Random arrivals (prompt length, passes run after it) against an independent account:
    the tokens of later-arrived prompts run in earlier passes than a prompt's own stay below
    its length plus one pass (the pass that made it overdue), and everything runs."""
    sched = prefill_scheduler(max_num_seqs=64, max_batch_tokens=10**6, num_blocks=10**5,
                              pass_tokens=pass_tokens)  # fmt: skip
    arrived: dict[str, int] = {}  # id -> arrival index
    length: dict[str, int] = {}
    passes: list[list[str]] = []

    def step() -> None:
        out = run_step(sched)
        if out.prefills:
            passes.append([s.seq_id for s, _ in out.prefills])

    for i, (n, steps) in enumerate(arrivals):
        rid = str(i)
        sched.add(make_request(rid, n))
        arrived[rid], length[rid] = i, n
        for _ in range(steps):
            step()
    while sched.waiting:
        step()
    assert sorted(r for p in passes for r in p) == sorted(arrived)
    longest_pass = max(sum(length[r] for r in p) for p in passes)
    for k, p in enumerate(passes):
        for rid in p:
            later = sum(length[o] for q in passes[:k] for o in q if arrived[o] > arrived[rid])
            if pass_tokens == 0:
                assert later == 0  # arrival order
            else:
                assert later < length[rid] + longest_pass
