"""The decoder's forward on the fused CPU kernels (kernels.py, cpu_kernels.c).

The same modules and weights as model.py's eager forward; only the small ops change. A layer
is nine calls: add+RMSNorm, the QKV matmul, RoPE+cache write, attention, the output matmul,
add+RMSNorm, the gate/up matmul, SiLU x up, the down matmul. The residual stream `h` is
updated in place by each add+RMSNorm, which also normalizes it for the next block (so the
final norm is the last layer's second add). Prefill spans still run torch's SDPA: they are
compute, not dispatch. Tests hold this forward to the eager one
(tests/component/test_fused_engine.py) and each kernel to the ops it replaces
(tests/unit/test_kernels.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.common.engine.interface import LayerHook
    from pdserve.common.engine.kernels import CpuKernels
    from pdserve.common.engine.kv_cache import KVCache
    from pdserve.common.engine.model import Attention, AttentionMetadata, LlamaModel


def forward(
    model: LlamaModel,
    kern: CpuKernels,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    on_layer: LayerHook | None,
) -> torch.Tensor:
    check_bounds(model, meta, cache, positions)
    layers, eps = model.decoder_layers, model.cfg.rms_norm_eps
    h = model.embed_tokens(input_ids)  # (T, hidden), ours: updated in place below
    x = kern.rms_norm(h, layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(layers):
        a = attention(layer.self_attn, kern, x, positions, meta, cache, model.rope_f32)
        if on_layer is not None:
            on_layer(i)
        x = kern.add_rms_norm(h, a, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp.down_proj(kern.silu_mul(layer.mlp.gate_up(x)))
        following = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        x = kern.add_rms_norm(h, m, following.weight, eps)
    return x


def _within(t: torch.Tensor | None, low: int, high: int, what: str) -> None:
    if t is None or t.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(t))
    if lo < low or hi >= high:
        raise IndexError(f"{what} out of range: [{lo}, {hi}] outside [{low}, {high})")


def check_bounds(
    model: LlamaModel, meta: AttentionMetadata, cache: KVCache, positions: torch.Tensor
) -> None:
    """What the C kernels index with, checked once a step (~10 us): a bad index is an
    IndexError, as with torch's own ops, never a read or write outside a tensor."""
    _within(positions, 0, model.rope_f32[0].shape[0], "positions")
    _within(meta.slot_mapping, 0, cache.k_v[0][0].shape[0], "KV slots")
    if meta.decode_blocks is not None and meta.decode_lens is not None:
        _within(meta.decode_blocks, 0, cache.num_blocks, "decode block ids")
        _within(meta.decode_lens, 1, meta.decode_blocks.shape[1] * cache.block_size + 1,
                "decode context lengths")  # fmt: skip


def attention(
    attn: Attention,
    kern: CpuKernels,
    x: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    qkv = attn.qkv(x)  # (T, (H + 2 KVH) * D), contiguous
    heads = (attn.n_heads, attn.n_kv, attn.head_dim)
    k_cache, v_cache = cache.k_v[attn.layer]
    kern.rope_write(qkv, *rope, positions, meta.slot_mapping, k_cache, v_cache, heads)
    blocks, lens, bs = meta.decode_blocks, meta.decode_lens, cache.block_size
    if not meta.prefills and blocks is not None and lens is not None:  # a decode-only step
        return attn.o_proj(kern.decode_attention(qkv, k_cache, v_cache, blocks, lens, heads, bs))
    qk_size = attn.q_size + attn.kv_size
    q = qkv[:, : attn.q_size].view(-1, attn.n_heads, attn.head_dim)
    k = qkv[:, attn.q_size : qk_size].view(-1, attn.n_kv, attn.head_dim)
    v = qkv[:, qk_size:].view(-1, attn.n_kv, attn.head_dim)
    out = attn.prefill_attention(q, k, v, meta, cache)  # (T, H, D)
    if blocks is not None and lens is not None:  # the decode rows after the prefill spans
        n = meta.num_prefill_tokens
        decoded = kern.decode_attention(qkv[n:], k_cache, v_cache, blocks, lens, heads, bs)
        out[n:] = decoded.view(-1, attn.n_heads, attn.head_dim)
    return attn.o_proj(out.view(-1, attn.q_size))
