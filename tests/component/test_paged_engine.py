"""Paged attention, chunked prefill and KV export/import on the real SmolLM2 model (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.common.engine.interface import DecodeWork, PrefillWork
from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS, chat_ids, make_engine

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def dense_last_logits(runner, ids: list[int]) -> torch.Tensor:
    """Reference: one-shot causal attention over the whole sequence (no cache reads)."""
    table = list(range(runner.num_blocks - 1, runner.num_blocks - 1 - len(ids) // 16 - 1, -1))
    return runner.forward([PrefillWork("ref", ids, 0, table, None)], [], all_rows=True)[-1]


def test_batched_paged_decode_equals_dense_attention(smol_runner, tokenizer):
    r = smol_runner
    seqs = [
        tokenizer.encode(t)
        for t in (
            "Hi",
            "The quick brown fox jumps over the lazy dog " * 3,
            "Count: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",
        )
    ]
    tables = [[3, 9, 4, 11], [20, 7, 15, 30], [40, 2, 33, 5]]  # scattered, non-contiguous blocks
    for ids, table in zip(seqs, tables, strict=True):
        r.forward([PrefillWork("p", ids[:-1], 0, table, None)], [])
    decodes = [
        DecodeWork(str(i), ids[-1], len(ids) - 1, table, GREEDY)
        for i, (ids, table) in enumerate(zip(seqs, tables, strict=True))
    ]
    batched = r.forward([], decodes)
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(batched[i], dense_last_logits(r, ids), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot(smol_runner, tokenizer):
    prompts = [chat_ids(tokenizer, p * 3) for p in CHAT_PROMPTS[:3]]
    whole = make_engine(smol_runner, tokenizer).generate(prompts, GREEDY)
    chunked = make_engine(smol_runner, tokenizer, chunk_size=32).generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    # logits of a prompt prefilled in 3 chunks vs at once
    ids, table = prompts[0], list(range(40, 60))
    r = smol_runner
    one_shot = r.forward([PrefillWork("a", ids, 0, table, None)], [], all_rows=True)
    parts = [
        r.forward([PrefillWork("a", ids[s : s + 23], s, table, None)], [], all_rows=True)
        for s in range(0, len(ids), 23)
    ]
    torch.testing.assert_close(torch.cat(parts), one_shot, rtol=1e-4, atol=1e-4)


def test_exported_kv_continues_exactly_in_another_cache(smol_runner, tokenizer):
    src = smol_runner
    dst = copy.copy(src)  # same weights, its own cache
    mc = src.model_config
    dst.kv_cache = KVCache(
        mc.num_layers, 64, src.block_size, mc.num_kv_heads, mc.head_dim, src.dtype
    )
    ids = chat_ids(tokenizer, "Tell me a short story about a robot.")  # crosses block boundaries
    n = len(ids)
    assert n % src.block_size != 0
    src_table, dst_table = [100 + i for i in range(8)], [50, 3, 17, 8, 60, 1, 9, 33]

    frames = {}
    first = src.step(
        [PrefillWork("a", ids, 0, src_table, GREEDY)],
        [],
        on_layer=lambda i: frames.__setitem__(i, src.kv_store.export_kv(i, src_table, n).clone()),
    )
    assert sorted(frames) == list(range(mc.num_layers))
    assert frames[0].shape == (2, n, mc.num_kv_heads, mc.head_dim)
    assert frames[0].numel() * 4 == src.kv_store.frame_bytes(n)
    for layer, frame in frames.items():  # through raw bytes, as the wire carries them
        dst.kv_store.import_kv(layer, dst_table, n, memoryview(frame.numpy()).cast("B"))
        assert torch.equal(dst.kv_store.export_kv(layer, dst_table, n), frame)

    def continue_decode(runner, table, steps=20):
        toks = [first[0]]
        for i in range(steps):
            toks += runner.step([], [DecodeWork("a", toks[-1], n + i, table, GREEDY)])
        return toks

    assert continue_decode(dst, dst_table) == continue_decode(src, src_table)


def test_seeded_sampling_is_reproducible_across_batches(smol_runner, tokenizer):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    prompt = chat_ids(tokenizer, "Write a poem.")
    alone = make_engine(smol_runner, tokenizer).generate([prompt], p)[0].token_ids
    others = [chat_ids(tokenizer, t) for t in CHAT_PROMPTS[:3]]
    crowd = (
        make_engine(smol_runner, tokenizer)
        .generate([*others, prompt], [GREEDY] * 3 + [p])[-1]
        .token_ids
    )
    assert alone == crowd
    other_seed = make_engine(smol_runner, tokenizer).generate([prompt], p.with_seed(12))[0]
    assert other_seed.token_ids != alone


def test_stop_strings_eos_and_max_tokens(smol_runner, tokenizer):
    engine = make_engine(smol_runner, tokenizer)
    prompt = chat_ids(tokenizer, CHAT_PROMPTS[0])
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in tokenizer.eos_token_ids
    assert "Paris" in free.text
    cut = engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=("Paris",))
    )[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index("Paris")]
    short = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    by_id = engine.generate(
        [prompt],
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(free.token_ids[2],)),
    )[0]
    assert by_id.token_ids == free.token_ids[:3] and by_id.finish_reason == "stop"
    assert engine.scheduler.block_manager.num_in_use_blocks == 0


def test_prefix_caching_changes_no_output(smol_runner, tokenizer):
    """Greedy and seeded text with the prefix cache on equals the text with it off: a prompt
    that reuses another's blocks, one that diverges mid-block, and one whose cached blocks
    were evicted a moment ago by a request that needed the room."""
    import dataclasses

    from pdserve.common.engine.scheduler import Scheduler

    story = chat_ids(tokenizer, "Tell me a long story about a lighthouse keeper and a storm.")
    assert len(story) > 40
    diverged = story[:37] + tokenizer.encode(" and then the cat arrived", False)  # mid-block
    longer = story + tokenizer.encode(" It was night.", False)
    filler = tokenizer.encode("Numbers: " + " ".join(str(i) for i in range(90)), False)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=21)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    order = [(story, greedy), (diverged, greedy), (longer, seeded), (filler, greedy),
             (story, seeded), (longer, greedy)]  # fmt: skip
    off = make_engine(smol_runner, tokenizer, prefix_caching="off")
    expected = [off.generate([p], params)[0].token_ids for p, params in order]

    on = make_engine(smol_runner, tokenizer)
    small = dataclasses.replace(on.scheduler.cfg, num_blocks=24, record_events=True)
    on.scheduler = Scheduler(small)  # 384 tokens: the filler evicts the story's blocks
    got = [on.generate([p], params)[0].token_ids for p, params in order]
    assert got == expected
    sched = on.scheduler
    assert sched.prefix_hits >= 32  # the diverged and longer prompts did reuse blocks
    events, lost = sched.block_manager.take_events()
    assert not lost and any(not stored for stored, _ in events)  # and blocks were evicted


def test_blocks_evicted_to_the_host_and_disk_tiers_load_back_with_the_same_output(
    smol_runner, tokenizer, tmp_path
):
    """The story's blocks leave a tiny KV cache for the host pool and, overflowing it, the
    disk; the next prompts sharing that prefix load them back instead of recomputing, and
    the text equals the text with no cache at all."""
    import dataclasses

    from pdserve.common.engine.scheduler import Scheduler
    from pdserve.common.engine.tiers import TierStore

    story = chat_ids(tokenizer, "Tell me a long story about a lighthouse keeper and a storm.")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    numbers = [tokenizer.encode(" ".join(str(i) for i in range(k)), False) for k in range(200)]
    filler = next(f for f in numbers if len(f) + 6 > 23 * 16)  # needs every one of 24 blocks
    order = [story, filler, story + tokenizer.encode(" Then dawn came.", False)]
    off = make_engine(smol_runner, tokenizer, prefix_caching="off")
    expected = [off.generate([p], greedy)[0].token_ids for p in order]

    on = make_engine(smol_runner, tokenizer)
    on.scheduler = Scheduler(
        dataclasses.replace(on.scheduler.cfg, num_blocks=24, watermark_blocks=0)
    )
    block = smol_runner.kv_cache.block_bytes()
    tiers = TierStore(host_bytes=block, disk_bytes=64 * block, disk_dir=tmp_path)
    kv = smol_runner.kv_store
    on.scheduler.attach_tiers(tiers, kv.read_block, kv.write_block)
    got = [on.generate([p], greedy)[0].token_ids for p in order]
    assert got == expected
    # the story's two full blocks came back, spilled to disk by then (the host pool holds
    # one block, and the filler's blocks followed the story's out of the cache)
    assert tiers.stats["host_hits"] + tiers.stats["disk_hits"] == 2
    assert tiers.stats["disk_hits"] >= 1 and tiers.stats["spilled"] >= 2
    assert on.scheduler.prefix_hits >= 2 * 16


def test_a_block_read_from_one_cache_writes_into_another_byte_exact(smol_runner):
    kv = smol_runner.kv_store
    data = kv.read_block(3)
    kv.write_block(9, data)
    assert kv.read_block(9) == data and len(data) == smol_runner.kv_cache.block_bytes()
