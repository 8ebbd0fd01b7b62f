"""GGUF's 4- and 8-bit blocks, kept quantized: repacked once into what torch's CPU kernels run.

Not wired into the model yet (issue 16's first step): the repacking and the linear layers,
each checked against the GGUF's own dequantization.

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
    """y = x @ W.T with W kept as 4-bit groups of 32 (CPU kernel)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(
        self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 1)
        sz = torch.stack([torch.from_numpy(scale).T, torch.from_numpy(zero).T], dim=-1)
        self.register_buffer("packed", packed)  # (N, K / 2) uint8
        self.register_buffer("scales_zeros", sz.to(dtype).contiguous())  # (K/32, N, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scales_zeros)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """W as float32 (tests, fallbacks): the identity matrix through the kernel."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return self.forward(eye).float().T


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
