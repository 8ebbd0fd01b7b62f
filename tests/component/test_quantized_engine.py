"""The engine with the GGUF's 4-bit blocks kept (--quantization int4) against the same engine
with them dequantized: greedy text on the chat prompts agrees for at least 30 of 32 tokens per
prompt, and perplexity on a fixed text within 1 %.

Greedy text is compared in float32 activations, where gguf_matmul.c's kernel runs the
generated tokens' rows on the GGUF's own values (measured: 32 of 32 tokens on every prompt).
In bfloat16, where torch's 4-bit kernel pays, greedy text diverges from float32 after 2-23
tokens on some prompts with the dequantized weights as much as with the 4-bit ones (bf16's
own rounding), so there the check is perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.cbuild import build
from pdserve.common.config import EngineConfig
from pdserve.common.engine.gguf_linear import GgufLinear
from pdserve.common.engine.interface import PrefillWork
from pdserve.common.engine.packed import PackedLinear
from pdserve.common.engine.quant import DENSE_FROM, Int4Linear, Int8Linear, Q8Linear
from pdserve.common.engine.runner import ModelRunner
from pdserve.common.quant_choice import choice
from pdserve.common.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS, chat_ids, make_engine

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
TEXT = (
    "The Roman Empire was the post-Republican state of ancient Rome. It included territory "
    "around the Mediterranean in Europe, North Africa, and Western Asia, and was ruled by "
    "emperors. From the accession of Caesar Augustus as the first Roman emperor to the "
    "military anarchy of the third century, it was a Principate with Italia as the "
    "metropole of its provinces and the city of Rome as its sole capital. The Empire was "
    "later ruled by multiple emperors who shared control over the Western Roman Empire and "
    "the Eastern Roman Empire. Rome remained the nominal capital of both parts until 476 AD, "
    "when the imperial insignia were sent to Constantinople following the capture of the "
    "Western capital of Ravenna by the Germanic barbarians under Odoacer. "
    "Photosynthesis is a process used by plants and other organisms to convert light energy "
    "into chemical energy that, through cellular respiration, can later be released to fuel "
    "the organism's activities. Some of this chemical energy is stored in carbohydrate "
    "molecules, such as sugars and starches, which are synthesized from carbon dioxide and "
    "water. Most plants, algae, and cyanobacteria perform photosynthesis; such organisms are "
    "called photoautotrophs. Photosynthesis is largely responsible for producing and "
    "maintaining the oxygen content of the Earth's atmosphere, and supplies most of the "
    "energy necessary for life on Earth."
)


def _pair(dtype: str) -> tuple[ModelRunner, ModelRunner]:
    cfg = dict(dtype=dtype, num_kv_blocks=256, kv_shared_cache="off")
    quantized = ModelRunner(EngineConfig(quantization="int4", **cfg))  # type: ignore[arg-type]
    plain = ModelRunner(EngineConfig(quantization="none", **cfg))  # type: ignore[arg-type]
    return quantized, plain


@pytest.fixture(scope="module")
def runners():
    return _pair("bfloat16")


@pytest.fixture(scope="module")
def runners32():
    return _pair("float32")


def test_auto_keeps_4_bit_blocks_only_where_they_pay():
    assert EngineConfig(dtype="bfloat16").quantization == "int4"  # embedded GGUF, CPU
    # float32: where this CPU's measurement (cached per kernel build) says the kernel wins
    built = build()
    assert not isinstance(built, str), built
    pays = choice(built.stem, built.parent)[0]
    assert EngineConfig(dtype="float32").quantization == ("int4" if pays else "none")
    assert EngineConfig(dtype="float32", cpu_kernels="off").quantization == "none"
    assert EngineConfig(dtype="bfloat16", engine="sim").quantization == "none"
    assert EngineConfig(dtype="bfloat16", model="/m/folder").quantization == "none"
    assert EngineConfig(dtype="bfloat16").numerics == "bfloat16+int4"  # nodes must agree
    assert EngineConfig(dtype="float32", quantization="none").numerics == "float32"


def test_every_projection_keeps_its_4_bit_blocks(runners):
    quantized, plain = runners
    layers = quantized.model.layers
    kinds = [
        type(m)
        for layer in layers
        for m in (
            layer.self_attn.qkv,
            layer.self_attn.o_proj,
            layer.mlp.gate_up,
            layer.mlp.down_proj,
        )
    ]
    assert kinds == [Int4Linear] * (4 * len(layers))
    assert isinstance(quantized.model.lm_head, Q8Linear)  # the GGUF's Q8_0 head, exactly
    # a float layer: in bf16 with its weight packed for oneDNN (packed.py)
    assert isinstance(plain.model.layers[0].self_attn.qkv, torch.nn.Linear | PackedLinear)


def test_in_float32_every_projection_and_the_head_keep_their_blocks(runners32):
    quantized, _ = runners32
    layers = quantized.model.layers
    mods = [m for layer in layers for m in (layer.self_attn.qkv, layer.self_attn.o_proj,
                                            layer.mlp.gate_up, layer.mlp.down_proj)]  # fmt: skip
    assert [(type(m), m.kind) for m in mods] == [(GgufLinear, "Q4_1")] * (4 * len(layers))
    head = quantized.model.lm_head
    assert isinstance(head, GgufLinear) and head.kind == "Q8_0" and head.rows is None
    # prompt rows share the model's float weight, no copy
    assert mods[0].dense is not None and mods[0].rows is quantized.model.step_rows
    # the path the node tells gateways (common/numerics.py): the blocks' SIMD code, not torch's
    assert f"linear=gguf-{mods[0].ops.path}" in quantized.code_path.split(";")
    # float32 weights too: generated rows on the same code's F32 kind (rows.py, row-invariant)
    assert f"linear=gguf-{mods[0].ops.path}" in runners32[1].code_path.split(";")


def test_greedy_text_agrees_for_30_of_32_tokens_per_prompt(runners32, tokenizer):
    quantized, plain = runners32
    prompts = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS[:4]]
    outs = [
        make_engine(r, tokenizer, prefix_caching="off").generate(prompts, GREEDY_32)
        for r in (quantized, plain)
    ]
    agree = []
    for q, p in zip(*outs, strict=True):
        pairs = zip(q.token_ids, p.token_ids, strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), 32)
        agree.append(same)
    print(f"\nint4 vs dequantized, greedy tokens agreeing per prompt: {agree}")
    assert len(agree) == 4 and min(agree) >= 30, agree


def _perplexity(runner: ModelRunner, ids: list[int]) -> float:
    logits = runner.forward(
        [PrefillWork("ppl", ids, 0, list(range(-(-len(ids) // 16))), None)], [], all_rows=True
    )
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return math.exp(float(nll))


def test_perplexity_on_a_fixed_text_within_one_percent(runners, tokenizer):
    """In bfloat16 (float32 is exact: the greedy test and tests/unit/test_quant.py)."""
    quantized, plain = runners
    ids = tokenizer.encode(TEXT)
    layers = [m for m in quantized.model.modules() if isinstance(m, Int4Linear | Q8Linear)]
    for m in layers:  # every row through the 4-bit kernel (a 260-token pass would run dense)
        m.dense_from = 1 << 30
    try:
        pq = _perplexity(quantized, ids)
    finally:
        for m in layers:
            m.dense_from = DENSE_FROM
    pp = _perplexity(plain, ids)
    print(f"\nperplexity on {len(ids)} tokens: int4 {pq:.4f}, dequantized {pp:.4f}")
    assert abs(pq / pp - 1) <= 0.01


def test_int8_at_load_quantizes_every_projection_within_one_percent_perplexity(
    runners, runners32, tokenizer
):
    """--quantization int8 (any model; here the GGUF's weights dequantized, as a safetensors
    model would arrive): every projection int8 per output channel, the LM head float.
    The loss is measured in float32, where it is the same on every CPU: +0.83 % (12.0764
    against 11.9768 on AVX512-BF16 and at PDSERVE_CPU_ISA=avx2 alike, equal to 1e-5); one
    scale per row of weights that came as 4-bit groups is coarser than the groups, so int4
    keeps those. In bfloat16 the same ratio is that loss plus bf16 rounding, which depends on
    the CPU's kernels (measured: +0.09 % on AVX512-BF16, +1.04 % on an AVX2-only EPYC and at
    the avx2 level), so bf16 is held to float32 instead: each bf16 perplexity within 1 % of its
    float32 one (measured spread -0.62 % to +0.23 % for the plain weights, -0.52 % to -0.41 %
    for int8, across those CPUs)."""
    pairs = {}
    plains = {"float32": runners32[1], "bfloat16": runners[1]}  # the module's, dequantized
    for dtype in ("float32", "bfloat16"):
        cfg = dict(dtype=dtype, num_kv_blocks=64, kv_shared_cache="off")
        q8 = ModelRunner(EngineConfig(quantization="int8", **cfg))  # type: ignore[arg-type]
        assert EngineConfig(quantization="int8", dtype=dtype).numerics == f"{dtype}+int8"
        layers = q8.model.layers
        mods = [m for layer in layers for m in (layer.self_attn.qkv, layer.mlp.down_proj)]
        assert {type(m) for m in mods} == {Int8Linear}
        # float32 routes by the step's rows (prompt rows dense), bf16 by their count
        want = q8.model.step_rows if dtype == "float32" else None
        assert all(m.rows is want for m in mods)
        # float32: generated rows on gguf_matmul.c's F32 kind over the dense copy, not on
        # torch's int8 kernel, which takes float activations 10-60x slower
        assert all((m.generated is not None) == (dtype == "float32") for m in mods)
        # the float head: float32 on the F32 kernel (gguf_linear.f32_linears), bf16 packed
        head = q8.model.lm_head
        assert isinstance(
            head, GgufLinear if dtype == "float32" else torch.nn.Linear | PackedLinear
        )
        for m in q8.model.modules():  # bf16: every row through the int8 kernel; float32:
            if isinstance(m, Int8Linear) and dtype == "bfloat16":  # its dense copy holds the
                m.dense_from = 1 << 30  # same int8 values exactly, and runs 10x faster
        plain = plains[dtype]
        assert plain.cfg.quantization == "none" and plain.dtype == q8.dtype
        ids = tokenizer.encode(TEXT)
        pairs[dtype] = (_perplexity(q8, ids), _perplexity(plain, ids))
        print(f"\nperplexity on {len(ids)} tokens, {dtype}: int8 {pairs[dtype][0]:.4f}, "
              f"dequantized {pairs[dtype][1]:.4f}")  # fmt: skip
    (q32, p32), (q16, p16) = pairs["float32"], pairs["bfloat16"]
    assert abs(q32 / p32 - 1) <= 0.01  # the quantization's own loss
    assert abs(q16 / q32 - 1) <= 0.01 and abs(p16 / p32 - 1) <= 0.01  # bf16's rounding


def test_a_safetensors_model_is_quantized_to_int8_at_load(tmp_path):
    """--quantization int8 on a Hugging Face folder (config.json + model.safetensors): every
    projection is int8 per output channel, and the logits stay close to the float model's
    (a random tiny Llama in float32: measured max error 3 % of the largest logit, mean
    error 1.7 % of the mean)."""
    from safetensors.torch import save_file

    from tests.component.test_loading import LLAMA, hf_folder

    folder = hf_folder(tmp_path, {**LLAMA, "tie_word_embeddings": False})
    g = torch.Generator().manual_seed(3)
    h, inter, layers, vocab = 32, 64, 2, 100

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    weights = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": w(vocab, h)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[p + f"self_attn.{name}.weight"] = w(h, h)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                            ("down_proj", (h, inter))):  # fmt: skip
            weights[p + f"mlp.{name}.weight"] = w(*shape)
        weights[p + "input_layernorm.weight"] = torch.ones(h)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(weights, str(folder / "model.safetensors"))
    cfg = dict(model=str(folder), dtype="float32", num_kv_blocks=8, kv_shared_cache="off")
    q8 = ModelRunner(EngineConfig(quantization="int8", **cfg))  # type: ignore[arg-type]
    plain = ModelRunner(EngineConfig(quantization="none", **cfg))  # type: ignore[arg-type]
    assert all(isinstance(layer.mlp.gate_up, Int8Linear) for layer in q8.model.layers)
    ids = list(range(5, 25))
    work = [PrefillWork("x", ids, 0, [0, 1], None)]
    got, ref = q8.forward(work, [], all_rows=True), plain.forward(work, [], all_rows=True)
    err = (got - ref).abs()
    scale = ref.abs().mean()
    print(f"\nint8 logits: max error {err.max():.4f}, mean {err.mean():.4f} of {scale:.3f}")
    assert err.max() <= 0.05 * ref.abs().max() and err.mean() <= 0.02 * ref.abs().mean()


def test_perplexity_in_float32_through_the_blocks_within_one_percent(runners32, tokenizer):
    """Every row through gguf_matmul.c (a prompt's rows would run dense): the kernel's own
    loss against the same weights dequantized, float32 both (the 4-bit weights are exact, so
    only the order of the sums differs)."""
    quantized, plain = runners32
    ids = tokenizer.encode(TEXT)
    layers = [m for m in quantized.model.modules() if isinstance(m, GgufLinear)]
    saved = [m.rows for m in layers]
    for m in layers:
        m.rows = None
    try:
        pq = _perplexity(quantized, ids)
    finally:
        for m, rows in zip(layers, saved, strict=True):
            m.rows = rows
    pp = _perplexity(plain, ids)
    print(f"\nfloat32 perplexity on {len(ids)} tokens: blocks {pq:.4f}, dequantized {pp:.4f}")
    assert abs(pq / pp - 1) <= 0.01
