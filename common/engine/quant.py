"""GGUF's 4- and 8-bit blocks, kept quantized: repacked once into what torch's CPU kernels run.

`--quantization int4` in bfloat16 (also what `auto` picks for a GGUF model on CPU in
bfloat16, see common/config.py; float32 runs gguf_linear.py's C kernel instead) replaces the
model's projections after loading
(`quantize_gguf_linears`, called by the runner); the unpacking is checked against the GGUF's
own dequantization (tests/unit/test_quant.py).

GGUF blocks hold 32 weights of one row:
    Q4_0  d: f16, qs: 16 bytes          w = (q - 8) * d          q: 4-bit, 0..15
    Q4_1  d: f16, m: f16, qs: 16 bytes  w = q * d + m
    Q8_0  d: f16, qs: 32 x int8         w = q * d
where byte j of qs holds weight j in its low nibble and weight j + 16 in its high one.

`torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)` computes x @ W.T with
W[n, k] = (q[n, k] - 8) * sz[k // 32, n, 0] + sz[k // 32, n, 1]; so Q4_0 is (d, 0) and Q4_1
is (d, m + 8 d), exactly. With bf16 activations it beats a dense product at batch 1; with
fp32 activations it is several times slower than dense, so this path is for bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from pdserve.common.engine.packed import PACKED_DENSE_FROM, PackedLinear, pack, packed_linear
from pdserve.common.engine.rows import StepRows, by_step

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


class SmallBatchLinear(nn.Module):
    """A quantized kernel for few rows, a dense weight from `dense_from` rows on: the 4- and
    8-bit kernels win while a decode step reads fewer bytes, a dense matmul wins once the
    rows make it compute-bound (measured crossover 8-32 rows). `dense` None: kernel only.

    In float32 (`rows` set) the step decides instead, as in gguf_linear.GgufLinear: prompt
    rows on `dense` (row-padded, rows.py), generated rows on the kernel, whatever the batch
    holds; a switch by row count would give a row other bits in a bigger batch. torch's int8
    and int4 kernels' float32 rows do not depend on the batch (tests/unit/test_quant.py)."""

    in_features: int
    out_features: int
    dense: torch.Tensor | None
    dense_from: int
    packed_dense: torch.Tensor | None = None  # `dense` in oneDNN's layout (packed.py)
    rows: StepRows | None = None  # the model's step rows: float32 routes by them
    # float32, where gguf_matmul.c is built: generated rows on its F32 kind over `dense`
    # (gguf_linear.f32_linears). torch's int8 and int4 kernels take float activations
    # 10-60x slower than that at 1-16 rows; `dense` holds the kernel's int8 values x scales
    generated: Callable[[torch.Tensor], torch.Tensor] | None = None

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.rows is not None:
            out = by_step(flat, self.rows.prompt, self.dense, self.generated or self.kernel)
        elif self.packed_dense is not None and flat.shape[0] >= self.dense_from:
            out = packed_linear(flat, self.packed_dense, None)
        elif self.dense is not None and flat.shape[0] >= self.dense_from:
            out = torch.nn.functional.linear(flat, self.dense)
        else:
            out = self.kernel(flat)
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(SmallBatchLinear):
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

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK, self.scales_zeros)

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


class Int8Linear(SmallBatchLinear):
    """y = x @ W.T with W as int8 per output channel (torch._weight_int8pack_mm), and a
    dense copy of the same values from `dense_from` rows on, as Int4Linear."""

    weight: torch.Tensor
    scale: torch.Tensor
    dense: torch.Tensor | None

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, dense_from: int = 0
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())  # (N, K) int8
        self.register_buffer("scale", scale.to(dtype))  # (N,)
        self.dense_from = dense_from
        dense = (q.float() * scale.float()[:, None]).to(dtype) if dense_from else None
        self.register_buffer("dense", dense)

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype, dense_from: int = 0) -> Int8Linear:
        return cls(*int8_per_channel(w), dtype, dense_from)

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(flat, self.weight, self.scale)


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


def _by_step(layer: SmallBatchLinear, model: nn.Module, dtype: torch.dtype) -> SmallBatchLinear:
    """The layer, routed by the model's step rows in float32 (SmallBatchLinear)."""
    if dtype == torch.float32:
        layer.rows = model.step_rows  # type: ignore[assignment]
    return layer


def gguf_projections(layer: Any, cfg: Any) -> dict[tuple[Any, str], list[tuple[str, int]]]:
    """A decoder layer's fused projections -> the GGUF tensors they are made of, each with the
    head count to un-permute its rows by for RoPE (0: none), in the order they are stacked."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        (attn, "qkv"): [("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads), ("attn_v", 0)],
        (attn, "o_proj"): [("attn_output", 0)],
        (mlp, "gate_up"): [("ffn_gate", 0), ("ffn_up", 0)],
        (mlp, "down_proj"): [("ffn_down", 0)],
    }


def quantize_gguf_linears(model: nn.Module, path: object, cfg: object, dtype: torch.dtype) -> int:
    """Replace the model's projections (fused qkv, o_proj, fused gate_up, down_proj) by
    Int4Linear built from the GGUF's Q4 blocks; how many were replaced. A projection any of
    whose parts is stored otherwise (or has a bias) stays float."""
    from pdserve.common.model.config import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}  # type: ignore[arg-type]
    replaced = 0
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr, arg-type]
        groups = gguf_projections(layer, cfg)
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
            q4 = Int4Linear(q, scale, zero, dtype, dense_from=DENSE_FROM)
            setattr(owner, attr, _by_step(q4, model, dtype))
            replaced += 1
    return replaced


PROJECTIONS = (
    ("self_attn", "qkv"), ("self_attn", "o_proj"), ("mlp", "gate_up"), ("mlp", "down_proj"),
)  # fmt: skip


def quantize_int8(model: nn.Module, dtype: torch.dtype, dense_from: int = DENSE_FROM) -> int:
    """--quantization int8: every bias-free projection as int8 per output channel, quantized
    at load from the float weights (any model: safetensors, or a GGUF dequantized); how
    many were replaced. The LM head stays float: one scale per row of SmolLM2's 49,152-row
    head cost most of the quality (perplexity +1.7 % with it, +0.8 % without, float32)."""
    replaced = 0
    for layer in model.layers:  # type: ignore[union-attr]
        for owner_name, attr in PROJECTIONS:
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            if isinstance(linear, nn.Linear) and linear.bias is None:
                q8 = Int8Linear.from_float(linear.weight.data, dtype, dense_from)
                setattr(owner, attr, _by_step(q8, model, dtype))
                replaced += 1
    return replaced


class Q8Linear(SmallBatchLinear):
    """y = x @ W.T for a GGUF Q8_0 matrix (w = q * d, d per 32 weights), exactly, through the
    4-bit kernel twice: q = 16 * hi + lo with hi in -8..7 and lo in 0..15, so
    W = (hi + 8 - 8) * 16d + 0  +  (lo - 8) * d + 8d, two 4-bit planes with group scales
    and zeros (the same bytes as int8: half a byte per weight each). torch's int8 kernel
    takes one scale per row, which loses the per-32 scales: requantized that way, SmolLM2's
    LM head changed the greedy text after 10 tokens on one chat prompt. From `dense_from`
    rows on, `dense` (the float weight, e.g. the embedding it is tied to) runs instead."""

    def __init__(
        self,
        q: np.ndarray,
        scale: np.ndarray,
        dtype: torch.dtype,
        dense: torch.Tensor | None = None,
        dense_from: int = 0,
    ) -> None:
        super().__init__()
        hi = q.astype(np.int32) >> 4  # arithmetic shift: floor(q / 16), -8..7
        lo = q.astype(np.int32) & 15
        zeros = np.zeros_like(scale)
        self.high = Int4Linear(hi + 8, 16 * scale, zeros, dtype)
        self.low = Int4Linear(lo, scale, 8 * scale, dtype)
        self.out_features, self.in_features = q.shape
        self.dense = dense  # not a buffer: shared with its owner (a tied embedding)
        self.dense_from = dense_from if dense is not None else 0

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return self.high(flat) + self.low(flat)


def quantize_gguf_lm_head(model: nn.Module, path: object, dtype: torch.dtype) -> bool:
    """The LM head from the GGUF's Q8_0 blocks (Q8Linear): the largest single read of a small
    model's decode step (SmolLM2: 49,152 x 576, 57 MB in bf16, as much as its 30 layers in
    4-bit). The float weight stays for the embedding it may be tied to (a lookup reads a few
    rows) and, in bfloat16, for batches from DENSE_FROM rows. Whether the head was
    replaced."""
    from gguf import GGMLQuantizationType

    from pdserve.common.model.config import open_gguf

    head = model.lm_head  # type: ignore[union-attr]
    tensors = {t.name: t for t in open_gguf(path).tensors}  # type: ignore[arg-type]
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if not isinstance(head, nn.Linear) or head.bias is not None or t is None:
        return False
    if GGMLQuantizationType(t.tensor_type).name != "Q8_0":
        return False
    cols, rows = (int(d) for d in t.shape)
    q, scale = unpack_q8(np.asarray(t.data), rows, cols)
    assert (rows, cols) == tuple(head.weight.shape), ((rows, cols), head.weight.shape)
    q8 = Q8Linear(q, scale, dtype, head.weight.data, DENSE_FROM)
    if dtype == torch.float32:  # every row as a generated one: its rows are the sampled ones
        q8.rows = StepRows()  # never set by a step: no prompt rows
    model.lm_head = q8  # type: ignore[union-attr]
    return True


def prepack(model: nn.Module) -> int:
    """Pack the model's bf16 CPU weights in place; how many layers now run packed. A
    quantized layer drops its plain dense copy once packed (the embedding an LM head is tied
    to keeps its own reference to the shared tensor)."""
    count = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, SmallBatchLinear) and child.dense is not None:
                packed = pack(child.dense)
                if packed is not None:
                    child.packed_dense, child.dense = packed, None
                    child.dense_from = min(child.dense_from, PACKED_DENSE_FROM)
                    count += 1
            elif type(child) is nn.Linear and (packed := pack(child.weight.data)) is not None:
                setattr(owner, name, PackedLinear(child, packed))
                count += 1
    return count
