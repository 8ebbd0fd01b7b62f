"""A Llama-family decoder in plain torch, reading and writing a paged KV cache.

Tokens of a step are flattened into one (T, hidden) batch: first the prefill spans (whole
prompts or chunks of them), then one token per decoding sequence. Linear layers run once
over all T tokens; attention is per prefill span (causal over its context) and batched over
the decode sequences (one query each, gathered keys padded and masked). Q/K/V and
gate/up projections are fused into one matmul each, which matters on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.engine import fused
from pdserve.common.engine.gguf_linear import StepRows
from pdserve.common.engine.interface import LayerHook
from pdserve.common.engine.kernels import CpuKernels
from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.config import ModelConfig


def blank_linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    """nn.Linear with its parameters allocated on the default device, not initialized:
    load_weights sets every one and fails on any the checkpoint lacks, so nn.Linear's random
    init only cost time (~0.7 s of every node's start for SmolLM2). Built 1 x 1, whose init
    is free, then given its real parameters."""
    layer = nn.Linear(1, 1, bias=bias)
    layer.in_features, layer.out_features = n_in, n_out
    layer.weight = nn.Parameter(torch.empty(n_out, n_in))
    if bias:
        layer.bias = nn.Parameter(torch.empty(n_out))
    return layer


@dataclass
class PrefillSpan:
    """Query tokens [q_start, q_start + q_len) of the flat batch; they are the last q_len of a
    context of ctx_len tokens whose cache slots are `ctx_slots` (None when q_len == ctx_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of every token of the step
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode_blocks: torch.Tensor | None  # (B, nb) block table per decoding sequence, padded
    decode_bias: torch.Tensor | None  # (B, 1, 1, nb * block_size) float32: 0 real, -inf padding
    decode_lens: torch.Tensor | None = None  # (B,) int64: tokens of context, the newest included


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one op, not seven (61 norms a step). In float32 it gives
        # Hugging Face's values; in bf16 it rounds once where theirs rounds twice.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    if "freq_factors" in scaling:  # a GGUF's rope_freqs: llama.cpp divides each angle by its own
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind != "default":
        raise ModelLoadError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
    return inv_freq


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, head_dim)
        # rotate_half(x) * sin == roll(x, D/2) * (-sin | sin): the sign lives in the table
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", signed_sin, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin at the step's positions, (T, 1, head_dim) each: looked up once
        per step, not once per layer and tensor (120 fewer small ops a step for 30 layers)."""
        cos, sin = self.cos[positions], self.sin[positions]  # (T, head_dim)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half as a roll against Rotary's signed sin
    (4 ops, not 6; the same values: -a * b == a * -b exactly)."""
    # x: (T, heads, head_dim); cos, sin: (T, 1, head_dim)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv = blank_linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = blank_linear(self.q_size, cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        qk_size, heads = self.q_size + self.kv_size, self.n_heads + self.n_kv
        # RoPE on Q and K together: half the small ops of a decode step's rotations
        qk = apply_rotary(qkv[:, :qk_size].view(-1, heads, self.head_dim), *rope)  # (T, H+KVH, D)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]  # (T, H, D), (T, KVH, D)
        v = qkv[:, qk_size:].view(-1, self.n_kv, self.head_dim)
        cache.write(self.layer, meta.slot_mapping, k, v)
        if not meta.prefills and meta.decode_blocks is not None:  # a decode-only step
            out = self._decode_attention(q, cache, meta)
            return self.o_proj(out.reshape(-1, self.q_size))
        out = self.prefill_attention(q, k, v, meta, cache)
        if meta.decode_blocks is not None:
            out[meta.num_prefill_tokens :] = self._decode_attention(
                q[meta.num_prefill_tokens :], cache, meta
            )
        return self.o_proj(out.view(-1, self.q_size))

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """(T, H, D) with the prefill spans' rows filled (causal over each span's context);
        the decode rows after them are left for the caller."""
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            qs = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
            if span.ctx_slots is None:
                ks, vs = k[rows], v[rows]
                mask, causal = None, True
            else:
                ks, vs = cache.gather(self.layer, span.ctx_slots)
                # query i sits at context position ctx_len - q_len + i
                dev = q.device  # the mask lives where the scores do (a CPU mask fails on CUDA)
                q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=dev)
                ctx = torch.arange(span.ctx_len, device=dev)
                mask, causal = ctx.unsqueeze(0) <= q_pos.unsqueeze(1), False
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=True,
            )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode_attention(
        self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence against its gathered context. Written out as two batched
        matmuls because torch's CPU SDPA kernel is ~15x slower for q_len 1 in bf16 (and
        still 1.5-3x slower than these in torch 2.13)."""
        b, group = q.shape[0], self.n_heads // self.n_kv
        blocks, bias = meta.decode_blocks, meta.decode_bias
        assert blocks is not None and bias is not None
        k, v = cache.gather_blocks(self.layer, blocks)  # (B, KVH, L, D) each
        qg = q.view(b, self.n_kv, group, self.head_dim)  # (B, KVH, G, D)
        scores = torch.matmul(qg, k.transpose(-1, -2))  # (B, KVH, G, L)
        # float32 bias (0 or -inf where a slot is padding) + scale x scores, in one op
        scores = torch.add(bias, scores, alpha=self.head_dim**-0.5)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (B, KVH, G, L)
        return torch.matmul(probs, v).view(b, self.n_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = blank_linear(cfg.hidden_size, 2 * self.inter)
        self.down_proj = blank_linear(self.inter, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.embed_tokens = nn.Embedding(1, 1)  # its init is free; the real table follows
        self.embed_tokens.num_embeddings, self.embed_tokens.embedding_dim = cfg.vocab_size, hidden
        self.embed_tokens.weight = nn.Parameter(torch.empty(cfg.vocab_size, hidden))
        layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers = layers  # the same modules, typed for mypy
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions)
        self.lm_head = blank_linear(hidden, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kernels: CpuKernels | None = None  # fused CPU kernels, once use_kernels is called
        self.step_rows = StepRows()  # the step's prompt rows, for layers that treat them apart
        self.rope_f32: tuple[torch.Tensor, torch.Tensor] = (self.rotary.cos, self.rotary.sin)

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Run forward on the fused CPU kernels (fused.py), or eager ops with None. After
        load_weights: the kernels take RoPE tables in float32 whatever the model's dtype."""
        self.kernels = kernels
        self.rope_f32 = (self.rotary.cos.float().contiguous(), self.rotary.sin.float().contiguous())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm; KV of every layer lands in `cache`,
        and `on_layer(i)` runs as soon as layer i's KV is there (for layer-wise transfer)."""
        self.step_rows.prompt = meta.num_prefill_tokens  # prompt rows come first
        if self.kernels is not None:
            return fused.forward(self, self.kernels, input_ids, positions, meta, cache, on_layer)
        h = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, h.dtype)
        for i, layer in enumerate(self.decoder_layers):
            h = h + layer.self_attn(layer.input_layernorm(h), rope, meta, cache)
            if on_layer is not None:
                on_layer(i)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        fused = {
            "q_proj": ("qkv", 0),
            "k_proj": ("qkv", 1),
            "v_proj": ("qkv", 2),
            "gate_proj": ("gate_up", 0),
            "up_proj": ("gate_up", 1),
        }
        seen: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.") if not name.startswith("lm_head") else name
            parts = name.split(".")
            if len(parts) >= 4 and parts[-2] in fused:
                target, idx = fused[parts[-2]]
                prefix = ".".join(parts[:-2])
                key = f"{prefix}.{target}.{parts[-1]}"
                group = pending.setdefault(key, {})
                group[str(idx)] = tensor
                if len(group) == (3 if target == "qkv" else 2):
                    name, tensor = key, torch.cat([group[str(i)] for i in range(len(group))])
                    del pending[key]
                else:
                    continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            param = params.get(name)
            if param is None:
                continue  # e.g. rotary inv_freq buffers in some checkpoints
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            seen.add(name)
        missing = [
            n
            for n in params
            if n not in seen and not (n == "lm_head.weight" and self.cfg.tie_word_embeddings)
        ]
        if missing or pending:
            raise ModelLoadError(
                f"the checkpoint lacks weights: {sorted(missing)[:5] or sorted(pending)[:5]}"
            )
        self.to(dtype)
