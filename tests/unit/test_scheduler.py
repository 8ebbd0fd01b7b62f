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
