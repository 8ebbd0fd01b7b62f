"""The engine on the fused CPU kernels (fused.py, the default where they build) against the
same engine on eager torch ops (--cpu-kernels off), on the real SmolLM2.

float32: greedy text equal for 32 of 32 tokens on the chat prompts, and the logits of a mixed
step (a prompt's second chunk over its cached first chunk, beside decoding sequences) within
1e-4. bfloat16 + int4 (what `auto` runs here): perplexity within 0.5 % of float32 on the same
weights, and no further from it than eager bf16's; greedy text is not
compared there, since eager bf16 rounds attention scores and probabilities to bf16 where the
kernels keep float (more accurate, so the texts part at near-ties)."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import DecodeWork, PrefillWork
from pdserve.common.engine.kernels import CpuKernels
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.sampling import SamplingParams
from tests.component.test_quantized_engine import TEXT, _perplexity
from tests.conftest import CHAT_PROMPTS, chat_ids, make_engine

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _pair(**cfg: object) -> tuple[ModelRunner, ModelRunner]:
    base = dict(num_kv_blocks=128, kv_shared_cache="off", **cfg)
    fused = ModelRunner(EngineConfig(**base))  # type: ignore[arg-type]
    eager = ModelRunner(EngineConfig(cpu_kernels="off", **base))  # type: ignore[arg-type]
    assert isinstance(fused.model.kernels, CpuKernels) and eager.model.kernels is None
    return fused, eager


@pytest.fixture(scope="module")
def runners32():
    return _pair(dtype="float32", quantization="none")


def test_greedy_text_equals_the_eager_engine_in_float32(runners32, tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS[:4]]
    fused, eager = (
        make_engine(r, tokenizer, prefix_caching="off").generate(prompts, GREEDY) for r in runners32
    )
    for a, b in zip(fused, eager, strict=True):
        assert a.token_ids == b.token_ids


def test_a_mixed_step_gives_the_eager_logits(runners32, tokenizer):
    """Chunked prefill (the second chunk attends to the cached first) beside two decodes."""
    ids = tokenizer.encode(TEXT)[:150]
    others = [tokenizer.encode("The sea is"), tokenizer.encode("One, two, three,")]
    logits = []
    for runner in runners32:
        first = runner.step([PrefillWork("p", ids[:100], 0, list(range(10)), None)], [])
        assert first == []  # a chunk that does not end the prompt samples nothing
        decodes = []
        for n, other in enumerate(others):
            table = list(range(10 + 2 * n, 12 + 2 * n))
            [tok] = runner.step([PrefillWork(str(n), other, 0, table, GREEDY)], [])
            decodes.append(DecodeWork(str(n), tok, len(other), table, GREEDY))
        chunk = PrefillWork("p", ids[100:], 100, list(range(10)), GREEDY)
        logits.append(runner.forward([chunk], decodes, all_rows=True))
    assert logits[0].shape == (50 + 2, logits[0].shape[1])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_perplexity_in_bfloat16_int4_within_half_a_percent(tokenizer):
    """Both bf16 engines against float32 on the same 4-bit weights: the fused one within
    0.5 % of it, and no further from it than the eager one.
    Not fused against eager: eager bf16 is the less accurate one, by a margin that depends on
    the CPU (measured: fp32 11.977; fused 11.958, eager 12.051 on a Xeon with AMX, 0.77 %
    apart, where an AMD EPYC had them within 0.5 %)."""
    fused, eager = _pair(dtype="bfloat16", quantization="int4", num_threads=2)
    reference = ModelRunner(
        EngineConfig(num_kv_blocks=128, kv_shared_cache="off", dtype="float32",
                     quantization="int4", cpu_kernels="off", num_threads=2)
    )  # fmt: skip
    ids = tokenizer.encode(TEXT)
    pf, pe, pr = (_perplexity(r, ids) for r in (fused, eager, reference))
    print(f"\nperplexity on {len(ids)} tokens, int4: bf16 fused {pf:.4f}, bf16 eager {pe:.4f}, "
          f"float32 {pr:.4f}")  # fmt: skip
    assert abs(pf / pr - 1) <= 0.005
    assert abs(pf / pr - 1) <= abs(pe / pr - 1) + 0.001


def test_an_index_outside_the_cache_is_an_error_not_a_stray_write(runners32):
    fused, _ = runners32
    before = fused.kv_cache.data.clone()
    for work in (
        DecodeWork("x", 1, 5, [fused.num_blocks + 3], GREEDY),  # a block past the cache
        DecodeWork("x", 1, 10**6, list(range(8)), GREEDY),  # a position past the RoPE table
    ):
        with pytest.raises(IndexError):
            fused.step([], [work])
    assert torch.equal(fused.kv_cache.data, before)
