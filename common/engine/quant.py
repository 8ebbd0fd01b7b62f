"""GGUF's 4- and 8-bit blocks, kept quantized: repacked once into what torch's CPU kernels run.

`--quantization int4` (also what `auto` picks for a GGUF model on CPU in bfloat16, see
common/config.py) replaces the model's projections after loading
(`quantize_gguf_linears`, called by the runner); the unpacking is checked against the GGUF's
own dequantization (tests/unit/test_quant.py).

GGUF blocks hold 32 weights of one row:
    Q4_0  d: f16, qs: 16 bytes          w = (q - 8) * d          q: 4-bit, 0..15
    Q4_1  d: f16, m: f16, qs: 16 bytes  w = q * d + m
    Q8_0  d: f16, qs: 32 x int8         w = q * d
where byte j of qs holds weight j in its low nibble and weight j + 16 in its high one.

`torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)` computes x @ W.T with
W[n, k] = (q[n, k] - 8) * sz[k // 32, n, 0] + sz[k // 32, n, 1]; so Q4_0 is (d, 0) and Q4_1
is (d, m + 8 d), exactly. Measured on a 2-vCPU AMD EPYC with AVX512-BF16, a 576 -> 1536
linear at batch 1: fp32 dense 104 us, int4 with bf16 activations 36 us; with fp32
activations the same kernel takes 936 us, so the int4 path is for bf16 activations.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

BLOCK = 32
LAYOUTS = {"Q4_0": (2, 16), "Q4_1": (4, 16), "Q8_0": (2, 32)}  # (header bytes, qs bytes)


def unpack_q4(raw: np.ndarray, kind: str, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """GGUF Q4_0/Q4_1 bytes of a (rows, cols) matrix -> (q int32 (rows, cols) in 0..15,
    scale f32 (rows, cols/32), zero f32 (rows, cols/32)) with w = (q - 8) * scale + zero."""
    head, nq = LAYOUTS[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, head + nq)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)  # (rows, nb, 32)
    if kind == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return q.reshape(rows, cols), d, zero


def unpack_q8(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 -> (q int8 (rows, cols), scale f32 (rows, cols/32)) with w = q * scale."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    return q.reshape(rows, cols), d


class Int4Linear(nn.Module):
    """y = x @ W.T with W kept as 4-bit groups of 32 (CPU kernel).

    The 4-bit kernel wins while few rows go through (a decode step reads a quarter of the
    bytes); from `dense_from` rows on (a prefill chunk, a large decode batch) a dense matmul
    wins (measured, 576 -> 1536 in bf16: 32 rows take 556 us in int4, 215 us dense). With
    `dense_from` set, the layer also keeps W dense, from the same 4-bit values."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    dense: torch.Tensor | None

    def __init__(
        self,
        q: np.ndarray,
        scale: np.ndarray,
        zero: np.ndarray,
        dtype: torch.dtype,
        dense_from: int = 0,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 1)
        sz = torch.stack([torch.from_numpy(scale).T, torch.from_numpy(zero).T], dim=-1)
        self.register_buffer("packed", packed)  # (N, K / 2) uint8
        self.register_buffer("scales_zeros", sz.to(dtype).contiguous())  # (K/32, N, 2)
        self.dense_from = dense_from
        dense = None
        if dense_from:  # the same values: (q - 8) * scale + zero, per group of 32
            w = (torch.from_numpy(q).float() - 8) * torch.from_numpy(scale).repeat_interleave(
                BLOCK, dim=1
            ) + torch.from_numpy(zero).repeat_interleave(BLOCK, dim=1)
            dense = w.to(dtype).contiguous()  # (N, K)
        self.register_buffer("dense", dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense is not None and flat.shape[0] >= self.dense_from:
            out = torch.nn.functional.linear(flat, self.dense)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scales_zeros)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """W as float32: the identity matrix through the 4-bit kernel."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        out = torch._weight_int4pack_mm_for_cpu(eye, self.packed, BLOCK, self.scales_zeros)
        return out.float().T


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (safetensors models, quantized at load)."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ W.T with W as int8 per output channel (torch._weight_int8pack_mm)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale)
        return out.view(*x.shape[:-1], self.out_features)


# -- a loaded model's linear layers, from the GGUF's own 4-bit blocks --------------------------
def _q4(tensor: object, rows: int, cols: int, heads: int = 0) -> tuple[np.ndarray, ...] | None:
    """(q, scale, zero) of a Q4_0/Q4_1 GGUF tensor, rows un-permuted for RoPE when `heads`
    (as the float loader does); None for any other type (that layer stays float)."""
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(tensor.tensor_type).name  # type: ignore[attr-defined]
    if kind not in ("Q4_0", "Q4_1"):
        return None
    parts = unpack_q4(np.asarray(tensor.data), kind, rows, cols)  # type: ignore[attr-defined]
    if heads:
        from pdserve.common.engine.loader import _unpermute

        parts = tuple(_unpermute(p, heads) for p in parts)
    return parts


DENSE_FROM = 16  # rows from which a projection runs dense (measured crossover: 8-32 rows)


def quantize_gguf_linears(model: nn.Module, path: object, cfg: object, dtype: torch.dtype) -> int:
    """Replace the model's projections (fused qkv, o_proj, fused gate_up, down_proj) by
    Int4Linear built from the GGUF's Q4 blocks; how many were replaced. A projection any of
    whose parts is stored otherwise (or has a bias) stays float."""
    from pdserve.common.model_config import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}  # type: ignore[arg-type]
    replaced = 0
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr, arg-type]
        attn, mlp = layer.self_attn, layer.mlp
        groups = {
            (attn, "qkv"): [("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads),  # type: ignore[attr-defined]
                            ("attn_v", 0)],
            (attn, "o_proj"): [("attn_output", 0)],
            (mlp, "gate_up"): [("ffn_gate", 0), ("ffn_up", 0)],
            (mlp, "down_proj"): [("ffn_down", 0)],
        }  # fmt: skip
        for (owner, attr), names in groups.items():
            linear = getattr(owner, attr)
            if not isinstance(linear, nn.Linear) or linear.bias is not None:
                continue
            parts = []
            for name, heads in names:
                t = tensors.get(f"blk.{i}.{name}.weight")
                cols, rows = (int(d) for d in t.shape) if t is not None else (0, 0)
                got = _q4(t, rows, cols, heads) if t is not None else None
                if got is None:
                    break
                parts.append(got)
            if len(parts) != len(names):
                continue
            q, scale, zero = (np.concatenate([p[j] for p in parts]) for j in range(3))
            assert q.shape == tuple(linear.weight.shape), (q.shape, linear.weight.shape)
            setattr(owner, attr, Int4Linear(q, scale, zero, dtype, dense_from=DENSE_FROM))
            replaced += 1
    return replaced
