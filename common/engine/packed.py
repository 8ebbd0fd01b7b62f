"""bf16 weights in oneDNN's own blocked layout, packed once at load instead of at every call.

On CPU, `F.linear` in bfloat16 runs oneDNN's matmul, which reorders the weight into its
blocked layout on every call: for a decode step's few rows that reorder costs as much as the
product. Packing once (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight
freezing does) and calling `_linear_pointwise` runs the same kernel on the same numbers: the
result equals F.linear's bit for bit at every row count (tests/unit/test_packed.py), so text
does not change. float32 is not packed: oneDNN's fp32 kernel differs from F.linear in the
last bits and, at some shapes, by row count, which would break the float32 invariant that a
sequence's tokens do not depend on its batch; float32 layers run rows.py's padded F.linear
and gguf_matmul.c's F32 kernel instead (gguf_linear.f32_linears).

`quant.prepack(model)` (the runner calls it with --cpu-kernels auto) swaps every bf16 CPU
nn.Linear for a PackedLinear and gives every quantized layer's dense weight (quant.py's
`SmallBatchLinear.dense`, used from DENSE_FROM rows) its packed twin.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_ROWS = 16  # oneDNN's hint of the rows a call will bring: a decode batch's order
# Rows from which a quantized layer runs its packed dense weight instead of its 4-bit kernel:
# packed, the dense product wins earlier than through F.linear (quant.DENSE_FROM, 16). Measured
# on the embedded model's decode step (benchmarks/step_profile.py --dense-from): 8 rows tie
# (24.8 against 27.4 ms), 12 rows 30.0 against 36.9 ms dense, 4 rows 25.0 against 18.4 ms int4.
PACKED_DENSE_FROM = 8


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The (N, K) weight in oneDNN's layout, or None where that path does not apply or
    this torch has no oneDNN."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
    except (RuntimeError, AttributeError):  # a build without the op or without bf16 support
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ W.T + bias through the packed weight: (M, N)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear with its weight packed; the plain weight is dropped (the packed one is the
    same numbers), so the layer costs no more memory than before."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed  # an opaque oneDNN tensor: not a buffer (no state_dict, no .to)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = packed_linear(flat, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)
