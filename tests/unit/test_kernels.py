"""The fused CPU kernels (common/engine/cpu_kernels.c) against the eager torch ops they replace.

Norms, the residual add, SiLU x up and RoPE + cache write are held to the eager ops bit for
bit in bfloat16 (they emulate its roundings) and within float32's last bits otherwise; decode
attention, computed in float where eager rounds scores and probabilities to bf16, is held to
a float64 reference over the paged cache, and must not depend on the rest of the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.common.engine import kernels
from pdserve.common.engine.model import apply_rotary

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def kern(dtype: torch.dtype) -> kernels.CpuKernels:
    got = kernels.load(dtype, CPU, head_dim=64, group=3)
    assert isinstance(got, kernels.CpuKernels), got
    return got


def test_the_library_builds_here_and_is_cached_by_source_and_cpu():
    # CI and every machine of this project have a C compiler: the fused path is the tested one
    first, again = kernels.build(), kernels.build()
    assert isinstance(first, Path) and first.exists(), first
    assert again == first
    assert first.parent == kernels.cache_dir()


def test_no_kernels_for_other_devices_dtypes_or_shapes():
    assert isinstance(kernels.load(torch.float32, torch.device("cuda"), 64, 3), str)
    assert "float16" in str(kernels.load(torch.float16, CPU, 64, 3))
    assert isinstance(kernels.load(torch.float32, CPU, 1024, 3), str)
    assert isinstance(kernels.load(torch.float32, CPU, 63, 3), str)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold to fork
def test_norms_and_silu_equal_the_eager_ops(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    k = kern(dtype)
    x, d = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    exact = dtype == torch.bfloat16  # float32: sums add in another order
    check = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # RMSNorm's sum of squares adds in the compiler's vector order, torch's in its own: the
    # float results differ in the last bits, which in bf16 flips a rounding about once in
    # 150,000 elements (measured on a Xeon with AMX; none at these seeds on an AMD EPYC): so
    # bf16 norms are held to within one bf16 ulp and to at most 1 element in 10,000 unequal
    norm_check = check if not exact else near_bf16

    assert norm_check(k.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))

    h = x.clone()
    normed = k.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(h, x + d)  # the residual add rounds as eager's, in every dtype
    assert norm_check(normed, F.rms_norm(x + d, (576,), w, 1e-5))

    gate_up = torch.randn(rows, 2 * 1536, generator=g).to(dtype) * 4
    gate, up = gate_up.split(1536, dim=-1)
    assert check(k.silu_mul(gate_up), F.silu(gate) * up)


def near_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    unequal = int((a != b).sum())
    return unequal * 10_000 <= max(a.numel(), 10_000) and torch.allclose(
        a.float(), b.float(), rtol=2**-7, atol=0
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_write_equal_the_eager_ops(dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, tokens, slots_total = 9, 3, 64, 40, 128
    k = kern(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randperm(100, generator=g)[:tokens]
    slots = torch.randperm(slots_total, generator=g)[:tokens]
    freqs = torch.outer(torch.arange(100).float(), torch.rand(dim // 2, generator=g))
    cos = torch.cat([freqs, freqs], -1).cos()
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1)

    # eager: model.py's rotation, then KVCache.write's index_copy_
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    want = apply_rotary(qk, cos[positions].unsqueeze(1).to(dtype),
                        sin[positions].unsqueeze(1).to(dtype))  # fmt: skip
    want_k = torch.zeros(slots_total, kv_heads, dim, dtype=dtype)
    want_v = torch.zeros_like(want_k)
    want_k.index_copy_(0, slots, want[:, heads:])
    want_v.index_copy_(0, slots, qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))

    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    k.rope_write(qkv, cos, sin, positions, slots, got_k, got_v, (heads, kv_heads, dim))
    assert torch.equal(qkv[:, : (heads + kv_heads) * dim].view_as(want), want)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def reference_attention(q, k_cache, v_cache, table, length, block_size, group):
    """float64 softmax attention of one sequence: q (H, D) over its first `length` slots."""
    slots = [table[i // block_size] * block_size + i % block_size for i in range(length)]
    keys = k_cache[slots].double().repeat_interleave(group, dim=1)  # (L, H, D)
    values = v_cache[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


# (heads, KV heads, head_dim): SmolLM2's, then every other path of the kernel's dispatch
# (head_dim 64 and 128 with the group a constant or a variable, any other head_dim)
SHAPES = [(9, 3, 64), (8, 2, 64), (6, 3, 64), (16, 2, 128), (8, 2, 128), (6, 2, 128), (4, 2, 80)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_reads_the_paged_cache_and_ignores_the_batch(dtype, shape):
    g = torch.Generator().manual_seed(2)
    (heads, kv_heads, dim), bs, blocks = shape, 16, 64
    k = kern(dtype)
    k_cache = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kv_heads, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 300, 48, 129])  # one token, partial blocks, a full block
    nb = -(-int(lens.max()) // bs)
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm.roll(7 * i)[:nb] for i in range(len(lens))])  # scattered blocks
    row = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(len(lens), row, generator=g).to(dtype)

    out = k.decode_attention(qkv, k_cache, v_cache, tables, lens, (heads, kv_heads, dim), bs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    for b in range(len(lens)):
        q = qkv[b, : heads * dim].view(heads, dim)
        want = reference_attention(
            q, k_cache, v_cache, tables[b].tolist(), int(lens[b]), bs, heads // kv_heads
        )
        got = out[b].view(heads, dim).double()
        assert torch.allclose(got, want, rtol=tol, atol=tol), (b, (got - want).abs().max())
        # alone, with its own table trimmed to its blocks: the same bits
        own = tables[b : b + 1, : -(-int(lens[b]) // bs)].contiguous()
        alone = k.decode_attention(
            qkv[b : b + 1].contiguous(), k_cache, v_cache, own, lens[b : b + 1],
            (heads, kv_heads, dim), bs,
        )  # fmt: skip
        assert torch.equal(alone[0], out[b])


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    """A library cut short (a crash or power loss while it was written) was kept: every
    start reported "cannot load" and ran the eager ops for good."""
    real = kernels.build()
    assert not isinstance(real, str), real  # the suite needs a C compiler
    broken = tmp_path / "cpu_kernels-broken.so"
    broken.write_bytes(b"")
    builds = iter([broken, real])
    monkeypatch.setattr(kernels, "build", lambda: next(builds))
    monkeypatch.setattr(kernels, "_loaded", {})
    lib = kernels.library()
    assert not isinstance(lib, str), lib
    assert not broken.exists()  # the broken one is gone, the rebuilt one loaded


def test_a_tensor_not_in_host_memory_is_refused_before_the_c_reads_it():
    """The kernels take pointers: a CUDA tensor's would crash the process inside the C (a
    meta tensor stands in for it here, where no GPU is)."""
    from pdserve.common.engine.kernels import _ptr

    with pytest.raises(AssertionError, match="meta"):
        _ptr(torch.empty(4, device="meta"))
    assert _ptr(torch.zeros(4)) != 0


def test_a_pointer_that_does_not_span_what_the_c_reads_is_refused():
    """The C takes pointers and lengths: a positions or slots tensor shorter than qkv's rows,
    a cos table of another width, a norm weight shorter than a row, were read past their ends
    (asserts guarded some, and `python -O` drops asserts). Each is a ValueError first."""
    k = kern(torch.float32)
    heads, kv_heads, dim, tokens = 9, 3, 64, 4
    qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * dim)
    cos = sin = torch.zeros(16, dim)
    at = torch.arange(tokens)
    cache = torch.zeros(32, kv_heads, dim)
    k.rope_write(qkv, cos, sin, at, at, cache, cache.clone(), (heads, kv_heads, dim))  # fits
    bad = {
        "positions": (qkv, cos, sin, at[:1], at, cache),
        "slots": (qkv, cos, sin, at, torch.arange(2 * tokens), cache),
        "tables": (qkv, torch.zeros(16, dim // 2), torch.zeros(16, dim // 2), at, at, cache),
        "KV cache": (qkv, cos, sin, at, at, torch.zeros(32, kv_heads, dim // 2)),
    }
    for what, (q, c, s, p, slots, kc) in bad.items():
        with pytest.raises(ValueError, match=what):
            k.rope_write(q, c, s, p, slots, kc, kc.clone(), (heads, kv_heads, dim))
    # the tensors a step's first layer passed are not checked again: unless the rows differ
    longer = torch.zeros(2 * tokens, qkv.shape[1])
    k.rope_write(qkv, cos, sin, at, at, cache, cache.clone(), (heads, kv_heads, dim))
    with pytest.raises(ValueError, match="positions"):
        k.rope_write(longer, cos, sin, at, at, cache, cache.clone(), (heads, kv_heads, dim))
    x = torch.ones(2, 576)
    for w in (torch.ones(100), torch.ones(576, dtype=torch.bfloat16), torch.ones(2, 576)):
        with pytest.raises(ValueError, match="norm weight"):
            k.rms_norm(x, w, 1e-5)
        with pytest.raises(ValueError, match="norm weight"):
            k.add_rms_norm(x.clone(), x, w, 1e-5)
