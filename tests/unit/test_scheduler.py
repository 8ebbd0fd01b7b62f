import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=100, temperature=0.0)


def make_scheduler(**kw):
    cfg = dict(max_num_seqs=8, max_batch_tokens=64, chunk_size=0, num_blocks=32, block_size=4)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def make_request(seq_id: str, n: int) -> Sequence:
    return Sequence.new(seq_id, list(range(1, n + 1)), GREEDY)


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    n_tokens = sum(1 for s, n in out.prefills if s.num_computed_tokens + n == s.num_tokens)
    sched.on_step_done(out, [token] * (n_tokens + len(out.decodes)))
    return out


def test_whole_prompts_without_chunking_and_decode_next():
    sched = make_scheduler()
    sched.add(make_request("a", 10))
    sched.add(make_request("b", 6))
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.prefills] == [("a", 10), ("b", 6)]
    out = run_step(sched)
    assert [s.seq_id for s in out.decodes] == ["a", "b"] and not out.prefills


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched = make_scheduler(chunk_size=8)
    sched.add(make_request("a", 3))
    run_step(sched)
    sched.add(make_request("long", 20))
    out = run_step(sched)
    assert [s.seq_id for s in out.decodes] == ["a"]
    assert [(s.seq_id, n) for s, n in out.prefills] == [("long", 7)]
    chunks = [7]
    while sched.running[-1].num_output_tokens == 0:
        out = run_step(sched)
        chunks += [n for s, n in out.prefills]
        assert sum(n for _, n in out.prefills) + len(out.decodes) <= 8
    assert sum(chunks) == 20


def test_long_prompt_without_chunking_runs_alone_rather_than_starving():
    sched = make_scheduler(max_batch_tokens=16)
    sched.add(make_request("long", 40))
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.prefills] == [("long", 40)]


def test_a_long_prompt_runs_beside_the_decodes_not_after_every_one_ends():
    """A prompt past the step's budget waited until no sequence at all was decoding: under a
    long generation it, and every request queued behind it, waited for that generation."""
    sched = make_scheduler(max_batch_tokens=16, num_blocks=200)
    forever = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    sched.add(Sequence.new("running", [1, 2], forever))
    run_step(sched)
    sched.add(make_request("long", 20))
    sched.add(make_request("short", 2))
    out = run_step(sched)
    assert [s.seq_id for s in out.decodes] == ["running"]
    assert [(s.seq_id, n) for s, n in out.prefills] == [("long", 20)]  # and nothing else
    out = run_step(sched)
    assert ("short", 2) in [(s.seq_id, n) for s, n in out.prefills]


def test_a_sequence_ends_at_what_the_cache_holds_instead_of_hanging_the_queue():
    """A sequence that grew past what the cache (less the watermark) holds was preempted and
    could never be admitted again: it stayed at the head of the queue, every request behind
    it waited, and LLMEngine.generate spun for good. The engine's context limit is now the
    cache's at most: it ends there ("length") and the next request runs."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(engine="sim", num_kv_blocks=4, block_size=4))
    assert engine.engine.max_model_len == 4 * 4 - 1  # its KV and the next token's: 15
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    steps = 0
    engine.add_request("a", list(range(1000, 1008)), long)
    engine.add_request("b", list(range(2000, 2004)), SamplingParams(max_tokens=2))
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 200, [(q.seq_id, q.num_tokens) for q in engine.scheduler.waiting]


def test_admission_keeps_the_watermark_and_max_seqs():
    sched = make_scheduler(num_blocks=10, watermark_blocks=2, max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(str(i), 12))  # 3 blocks each
    out = run_step(sched)
    assert len(out.prefills) == 2  # max_num_seqs
    sched2 = make_scheduler(num_blocks=8, watermark_blocks=2)
    sched2.add(make_request("x", 16))  # 4 blocks
    sched2.add(make_request("y", 16))  # 4 more would break the watermark
    out = run_step(sched2)
    assert [s.seq_id for s, _ in out.prefills] == ["x"]


def test_out_of_blocks_preempts_the_newest_and_everything_finishes():
    sched = make_scheduler(num_blocks=6, block_size=4)
    seqs = [make_request(str(i), 7) for i in range(3)]  # 2 blocks each: cache full
    for s in seqs:
        sched.add(s)
    preempted = []
    for _ in range(200):
        if not sched.has_work:
            break
        out = run_step(sched)
        preempted += [s.seq_id for s in out.preempted]
        for s in list(sched.running):
            if s.num_output_tokens >= 6 and not s.is_prefilling:
                sched.finish(s, "length")
    assert not sched.has_work
    assert preempted and preempted[0] == "2"
    assert all(s.num_output_tokens >= 6 for s in seqs)
    assert sched.block_manager.num_in_use_blocks == 0


def test_finish_and_abort_free_blocks():
    sched = make_scheduler()
    a = make_request("a", 9)
    sched.add(a)
    run_step(sched)
    assert sched.block_manager.num_in_use_blocks == 3
    sched.finish(a, "abort")
    assert sched.block_manager.num_in_use_blocks == 0 and not sched.has_work


# -- prefill mode: the on-demand answer to offers, batches, parking until the handoff ------
def prefill_scheduler(**kw):
    return make_scheduler(mode="prefill", **kw)


def offer(sched, rid: str, n: int, queueing: bool = False) -> str | None:
    reason = sched.can_take(n, queueing)
    if reason is None:
        sched.add(make_request(rid, n))
    return reason


def test_on_demand_rejects_when_the_batch_or_its_token_budget_is_full():
    sched = prefill_scheduler(max_num_seqs=2, max_batch_tokens=100, num_blocks=50, block_size=16)
    assert offer(sched, "a", 60) is None
    assert "token budget" in offer(sched, "b", 50)
    assert offer(sched, "c", 30) is None
    assert "batch full" in offer(sched, "d", 1)
    out = run_step(sched)
    assert [s.seq_id for s, _ in out.prefills] == ["a", "c"]
    # prefilled: out of the batch, but holding their blocks until handed off
    assert not sched.running and set(sched.parked) == {"a", "c"}
    assert sched.block_manager.num_in_use_blocks == 4 + 2
    assert offer(sched, "e", 1) is None
    assert sched.release("a") is not None and sched.block_manager.num_in_use_blocks == 2 + 0


def test_a_long_prompt_alone_and_room_in_the_kv_cache():
    sched = prefill_scheduler(max_num_seqs=4, max_batch_tokens=100, num_blocks=50, block_size=16)
    assert offer(sched, "long", 300) is None  # alone: accepted, run alone
    assert "exceeds" in offer(sched, "huge", 16 * 51)
    small = prefill_scheduler(max_num_seqs=4, max_batch_tokens=1000, num_blocks=4, block_size=16)
    assert offer(small, "x", 48) is None
    assert "KV cache full" in offer(small, "y", 32)  # 3 of 4 blocks promised to x


def test_queueing_accepts_whatever_could_fit_and_batches_fifo():
    sched = prefill_scheduler(max_num_seqs=2, max_batch_tokens=100, num_blocks=50, block_size=16)
    for i in range(5):
        assert offer(sched, str(i), 40, queueing=True) is None
    assert [s.seq_id for s, _ in run_step(sched).prefills] == ["0", "1"]
    assert [s.seq_id for s, _ in run_step(sched).prefills] == ["2", "3"]
    sched.finish(sched.waiting[0], "abort")
    assert not sched.waiting


def test_decode_mode_hands_a_preempted_sequence_back_instead_of_requeueing_it():
    from pdserve.common.engine.sequence import SeqStatus

    sched = make_scheduler(mode="decode", num_blocks=4, block_size=4)
    for rid in ("a", "b"):
        seq = make_request(rid, 7)
        seq.block_table = sched.block_manager.allocate(2)
        seq.token_ids.append(9)  # the first token, from the prefill node
        seq.num_computed_tokens = 7
        sched.admit_prefilled(seq)
    assert not run_step(sched).preempted  # 8 tokens: two blocks hold them
    out = run_step(sched)  # both grow into a third block: only one can
    assert [s.seq_id for s in out.preempted] == ["b"] and not sched.waiting
    assert out.preempted[0].status is SeqStatus.PREEMPTED and not out.preempted[0].block_table
    assert [s.seq_id for s in out.decodes] == ["a"]


# -- prefix caching -------------------------------------------------------------------------
def caching_scheduler(**kw):
    return make_scheduler(prefix_caching=True, **kw)


def finish_prefill(sched, seq):
    while seq.num_output_tokens == 0:
        run_step(sched)


def test_a_shared_prefix_is_reused_and_only_the_rest_computed():
    sched = caching_scheduler(block_size=4, num_blocks=32)
    a = Sequence.new("a", list(range(1, 11)), GREEDY)  # 2 full blocks + 2 tokens
    sched.add(a)
    finish_prefill(sched, a)
    sched.finish(a, "stop")  # its blocks stay cached
    b = Sequence.new("b", [*range(1, 9), 50, 51, 52], GREEDY)  # same first 2 blocks
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.prefills] == [("b", 3)]
    assert b.num_cached_tokens == 8 and sched.prefix_hits == 8
    assert sched.prefix_queries == 10 + 11


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = caching_scheduler(block_size=4, num_blocks=32)
    a = Sequence.new("a", list(range(1, 9)), GREEDY)  # exactly 2 blocks
    sched.add(a)
    finish_prefill(sched, a)
    sched.finish(a, "stop")
    again = Sequence.new("again", list(range(1, 9)), GREEDY)
    sched.add(again)
    out = run_step(sched)
    assert [(s.seq_id, n) for s, n in out.prefills] == [("again", 4)]  # block 2 recomputed


def test_generated_tokens_are_cached_for_the_next_turn():
    sched = caching_scheduler(block_size=4, num_blocks=32)
    turn1 = Sequence.new("t1", [1, 2, 3, 4, 5, 6], GREEDY)
    sched.add(turn1)
    for _ in range(6):
        run_step(sched, token=9)
    history = list(turn1.token_ids)  # prompt + answer: 12 tokens, 11 with KV computed
    sched.finish(turn1, "stop")
    turn2 = Sequence.new("t2", [*history, 70, 71], GREEDY)
    sched.add(turn2)
    out = run_step(sched)
    # the answer's last token has no KV yet (it was never fed back): 2 blocks are cached
    assert turn2.num_cached_tokens == 8 and [n for _, n in out.prefills] == [6]


def test_off_means_no_hashing_and_no_reuse():
    sched = make_scheduler(block_size=4, num_blocks=32)
    a = Sequence.new("a", list(range(1, 11)), GREEDY)
    sched.add(a)
    finish_prefill(sched, a)
    assert not a.block_hashes and sched.block_manager.num_cached_blocks == 0


def test_hashes_are_salted_by_model_and_precision():
    from pdserve.common.engine.block_manager import hash_salt, prefix_hashes

    toks = list(range(32))
    fp32 = prefix_hashes(toks, 16, hash_salt("m", "float32", 16))
    bf16 = prefix_hashes(toks, 16, hash_salt("m", "bfloat16", 16))
    other = prefix_hashes(toks, 16, hash_salt("n", "float32", 16))
    assert len({fp32[0], bf16[0], other[0]}) == 3
    tail = prefix_hashes(toks, 16, hash_salt("m", "float32", 16), start=1, parent=fp32[0])
    assert tail == fp32[1:]  # a chain extends without rehashing its prefix


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), max_size=8),
    st.integers(1, 400),
    st.integers(1, 6),
    st.booleans(),
)
def test_room_is_exactly_the_longest_prompt_can_take_accepts(taken, n, max_seqs, steps):
    """The gateway skips offering a node prompts longer than the room its Reject reported:
    that is only sound if `can_take(m)` accepts exactly the prompts of room or fewer tokens."""
    sched = prefill_scheduler(max_num_seqs=max_seqs, max_batch_tokens=500, num_blocks=40)
    for i, m in enumerate(taken):
        offer(sched, f"r{i}", m)
        if steps and i % 3 == 2:
            run_step(sched)
    room = sched.room(False)
    assert (sched.can_take(n, False) is None) == (n <= room)
    assert sched.can_take(room, False) is None or room == 0
    assert sched.room(True) == sched.largest_prompt  # queueing: only the cache bounds it
    assert sched.can_take(sched.largest_prompt + 1, True) is not None


def test_a_tier_load_that_comes_up_short_is_computed_in_the_same_pass():
    """A prompt whose prefix is in the host tier (no disk tier) is admitted; allocating its
    blocks evicts other cached blocks into that full tier, which pushes out the very blocks
    it was to load. What did not load is computed in the same pass: the prompt is still one
    prefill (a prefill node sends a request's KV after its one pass: two passes sent it twice)."""
    from pdserve.common.engine.tiers import TierStore

    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=True, max_batch_tokens=64)
    tiers = TierStore(host_bytes=32)  # two blocks of 16 bytes
    loaded: list[int] = []
    sched.attach_tiers(tiers, lambda b: bytes([b]) * 16, lambda b, data: loaded.append(b))

    def serve(seq_id: str, tokens: list[int]) -> None:
        seq = Sequence.new(seq_id, tokens, SamplingParams(max_tokens=1, temperature=0.0))
        sched.add(seq)
        run_step(sched)
        sched.finish(seq, "length")  # its full blocks stay cached, in the free queue

    serve("a", list(range(1, 10)))  # blocks [1..4], [5..8] cached
    serve("b", list(range(100, 121)))  # needs all 6 blocks: a's two go to the tier
    assert tiers.stats["put"] == 2
    c = Sequence.new("c", [*range(1, 9), 50, 51, 52, 53, 54], GREEDY)  # a's prefix, then more
    sched.add(c)
    out = sched.schedule()
    assert tiers.stats["put"] > 2  # b's blocks evicted into the full tier by c's allocation
    assert [s.seq_id for s, _ in out.prefills] == ["c"]
    (_, n), cached = out.prefills[0], c.num_computed_tokens
    assert cached < 8  # a load came up short: what is computed is the rest, in this pass
    assert cached + n == c.num_tokens, (cached, n)
    assert len(loaded) * 4 == cached


def _evict_a_into_the_tier(sched: Scheduler) -> None:
    """Run prompt a (9 tokens: 2 full blocks), then b, whose allocation pushes a's blocks
    into the scheduler's tier."""
    for seq_id, tokens in (("a", list(range(1, 10))), ("b", list(range(100, 121)))):
        seq = Sequence.new(seq_id, tokens, SamplingParams(max_tokens=1, temperature=0.0))
        sched.add(seq)
        run_step(sched)
        sched.finish(seq, "length")  # b's allocation pushes a's blocks into the tier


def test_a_tier_load_that_fails_is_computed_and_leaks_no_block():
    """Copying a tier's block into the cache raises (out of device or pinned memory): what
    it was to load is computed. It raised out of `schedule`, the blocks taken for the
    sequence nobody's (the step loop stopped on it)."""
    from pdserve.common.engine.tiers import TierStore

    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=True, max_batch_tokens=64)
    tiers = TierStore(host_bytes=1024)

    def fail(block: int, data: bytes) -> None:
        raise MemoryError("pinned buffer")

    sched.attach_tiers(tiers, lambda b: bytes([b]) * 16, fail)
    _evict_a_into_the_tier(sched)
    assert tiers.stats["put"] >= 2
    c = Sequence.new("c", [*range(1, 9), 50], GREEDY)  # a's prefix, in the tier
    sched.add(c)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.prefills] == ["c"] and c.num_computed_tokens == 0
    assert sched.block_manager.num_in_use_blocks == len(c.block_table) == 3


def test_a_host_tier_load_is_timed_with_its_copy_into_the_cache():
    """The host tier's load cost timed only its dict lookup (~1e-14 s a byte), so loading
    from host memory always looked cheaper than recomputing. It is the copy that costs."""
    import time

    from pdserve.common.engine.tiers import TierStore

    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=True, max_batch_tokens=64)
    tiers = TierStore(host_bytes=1024)
    copied: list[int] = []

    def slow_copy(block: int, data: bytes) -> None:  # a copy of 16 bytes taking 20 ms
        time.sleep(0.02)
        copied.append(block)

    sched.attach_tiers(tiers, lambda b: bytes([b]) * 16, slow_copy)
    _evict_a_into_the_tier(sched)
    sched.add(Sequence.new("c", [*range(1, 9), 50], GREEDY))  # a's prefix, in the tier
    sched.schedule()
    assert copied and tiers.stats["host_hits"] == len(copied)
    assert tiers.load_cost["host"] > 0.2 * 0.02 / 16  # at least its share of the copy
    tiers.observe_prefill(tokens=1000, seconds=0.001)  # 1 us a token
    assert not tiers.worth_loading("host", 4)  # 20 ms a block loses to 4 us of prefill


def test_a_decode_node_decodes_every_sequence_it_holds_at_each_step_whatever_the_chunk_size():
    """The engine flags are shared by every role (`pdserve up --chunk-size N`): a decode node's
    scheduler took the chunk budget as its step's, and decoded only the oldest N of its
    streams while the newest got no token until those ended."""
    from pdserve.decode_node.server import DecodeRole

    base = make_scheduler(chunk_size=4, num_blocks=64).cfg
    sched = Scheduler(DecodeRole.scheduler_config(base))
    for i in range(6):
        sched.add(make_request(f"s{i}", 3))
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        run_step(sched)  # the six prompts (a decode node's own prefills), then only decodes
    for _ in range(3):
        out = run_step(sched)
        assert sorted(s.seq_id for s in out.decodes) == [f"s{i}" for i in range(6)]


def _decoding(sched: Scheduler, n: int, prompt: int = 7) -> list[Sequence]:
    """`n` sequences whose KV arrived (their first token from a prefill node)."""
    seqs = []
    for i in range(n):
        seq = make_request(f"d{i}", prompt)
        seq.block_table = sched.block_manager.allocate(sched.block_manager.blocks_needed(prompt))
        seq.token_ids.append(9)
        seq.num_computed_tokens = prompt
        sched.admit_prefilled(seq)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("chunk_size", [16, 0])
def test_a_decode_node_bounds_the_prompts_it_prefills_itself_in_one_step(chunk_size):
    """A decode node's own prefills (--local-prefill) took no budget: a burst of 12 waiting
    prompts ran in one step beside the decodes, stalling every stream by all 12 (~143 ms
    measured where a budget of 36 was asked). Now --chunk-size (in chunks), else
    --max-batch-tokens (whole prompts), bounds their tokens in a step; every running
    sequence still decodes at each step."""
    from pdserve.decode_node.server import DecodeRole

    base = make_scheduler(chunk_size=chunk_size, max_batch_tokens=24, num_blocks=256).cfg
    sched = Scheduler(DecodeRole.scheduler_config(base))
    streams = _decoding(sched, 10)  # more streams than either budget
    for i in range(12):
        sched.add(make_request(f"p{i}", 12))
    budget = chunk_size or 24
    steps = 0
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        out = run_step(sched)
        steps += 1
        assert sum(n for _, n in out.prefills) <= budget
        decoding = {s.seq_id for s in out.decodes}
        assert {s.seq_id for s in streams} <= decoding  # every stream, every step
    assert steps >= 12 * 12 // budget
    assert len(sched.running) == 22  # every prompt prefilled, no stream preempted


def test_a_prompt_half_prefilled_in_chunks_is_not_parked_to_migrate():
    """A local prompt in chunks has no first token and only part of its KV: a drain (or a
    rebalance) moving it would send half a prompt as a decoding sequence's KV. It stays;
    the decode role parks it once its first token is out."""
    from pdserve.decode_node.server import DecodeRole

    sched = Scheduler(DecodeRole.scheduler_config(make_scheduler(chunk_size=8).cfg))
    seq = make_request("p", 12)
    sched.add(seq)
    run_step(sched)
    assert seq.is_prefilling and not sched.park(seq)
    run_step(sched)
    assert not seq.is_prefilling and sched.park(seq)


def test_sequences_compare_by_identity():
    """`seq in sched.waiting` compared every field of the sequences before it (dataclass
    value equality); two requests alike (one id sent twice) are two sequences."""
    a, b = make_request("x", 5), make_request("x", 5)
    assert a == a and a != b and b not in [a]
    sched = make_scheduler()
    sched.add(a)
    sched.add(b)
    sched.finish(b, "abort")
    assert list(sched.waiting) == [a] and a.status.value == "waiting"
