"""GGUF's 4- and 8-bit blocks as shipped, times float32 activations (gguf_matmul.c).

`--quantization int4` in float32 on CPU (also what `auto` picks where the kernel beats a dense
float32 matmul in a measurement taken once per CPU and kernel build, common/quant_choice.py):
each
projection keeps its GGUF blocks for the rows of generated tokens, the ones a decode step
reads all the weights for, and its dense float weight (the model's own, no copy) for the rows
of prompt tokens, where a dense matmul is compute-bound and wins. Which rows are which comes
from the step (`StepRows`, set by the model's forward), never from the batch's size: a
generated token's row takes the same path whatever else is batched with it, which the
float32 token-for-token invariant needs. The LM head (SmolLM2: its tied Q8_0 embedding,
49,152 x 576) runs the kernel for every row.

torch's own 4-bit kernel (quant.Int4Linear) stays for bfloat16: with float32 activations it
is ~9x slower than dense.

The same kernels take a dense float32 matrix in place (kind F32, the weight's own storage
viewed as bytes): in float32 on CPU every other linear layer, all of them with
`--quantization none`, runs its generated rows there and its prompt rows on row-padded
F.linear (rows.py), since MKL's matmul gives a row other bits at few rows (`f32_linears`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pdserve.common.engine.kernels import library
from pdserve.common.engine.quant import SmallBatchLinear
from pdserve.common.engine.rows import RowLinear, StepRows, by_step

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "F32": 3}  # gguf_matmul.c's `kind`
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F32": 128}  # a block holds 32 weights
BLOCK = 32


class GgufOps:
    """gguf_matmul.c's two entry points on torch tensors (CPU, contiguous)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._matmul = lib.gguf_matmul_f32
        self._dequantize = lib.gguf_dequantize_f32
        self.path: str = lib.gguf_matmul_path().decode()  # the SIMD code it was built with

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
        """x (T, K) float32 @ W.T, W (N, K) as `blocks` (N, K / 32 * block bytes) -> (T, N)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and blocks.is_contiguous()
        assert x.device.type == blocks.device.type == "cpu"  # raw pointers: host memory only
        rows, k = x.shape
        n = blocks.shape[0]
        assert k % BLOCK == 0 and blocks.shape[1] * BLOCK == k * BLOCK_BYTES[kind], (k, kind)
        out = torch.empty((rows, n), dtype=torch.float32)
        status = self._matmul(x.data_ptr(), rows, k, blocks.data_ptr(), n, KINDS[kind],
                              out.data_ptr())  # fmt: skip
        if status != 0:
            raise ValueError(f"gguf_matmul_f32: {kind} with K={k}")
        return out

    def widen(self, data: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A GGUF tensor's blocks as the file holds them (read-only pages: only read) to
        float32 of `shape`, the bits of gguf's dequantization (loader.iter_weights)."""
        assert data.dtype == np.uint8 and data.flags.c_contiguous
        return self._widen(data.ctypes.data, data.size, kind, shape)

    def dequantize(self, blocks: torch.Tensor, kind: str) -> torch.Tensor:
        """W (N, K) float32: the values the kernel multiplies by."""
        assert blocks.is_contiguous() and blocks.dtype == torch.uint8
        assert blocks.device.type == "cpu"  # raw pointers: host memory only
        shape = (blocks.shape[0], blocks.shape[1] * BLOCK // BLOCK_BYTES[kind])
        return self._widen(blocks.data_ptr(), blocks.numel(), kind, shape)

    def _widen(self, ptr: int, nbytes: int, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        n, k = shape[0], int(np.prod(shape[1:]))
        assert k % BLOCK == 0 and nbytes == n * (k // BLOCK) * BLOCK_BYTES[kind], (shape, kind)
        out = torch.empty(shape, dtype=torch.float32)
        self._dequantize(ptr, n, k, KINDS[kind], out.data_ptr())
        return out


def gguf_ops() -> tuple[GgufOps, str] | str:
    """gguf_matmul.c's kernels and the key of their build (cache key of measurements), or why
    there are none."""
    lib = library()
    if isinstance(lib, str):
        return lib
    return GgufOps(lib), Path(lib._name).stem


class GgufLinear(nn.Module):
    """y = x @ W.T (+ bias): prompt rows on `dense` (when given) through rows.row_linear, the
    other rows on the blocks."""

    blocks: torch.Tensor

    def __init__(
        self,
        ops: GgufOps,
        blocks: torch.Tensor,
        kind: str,
        dense: torch.Tensor | None = None,
        rows: StepRows | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.ops, self.kind = ops, kind
        self.register_buffer("blocks", blocks.contiguous())  # (N, K / 32 * block bytes)
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] * BLOCK // BLOCK_BYTES[kind]
        self.dense = dense  # not a buffer: the float weight the model loaded (tied, maybe)
        self.rows = rows if dense is not None else None
        self.bias = bias  # added apart, as its own op: the same for every row

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return self.ops.matmul(rows, self.blocks, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        prompt = self.rows.prompt if self.rows is not None else 0
        out = by_step(flat, prompt, self.dense, self._kernel)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def f32_linears(model: nn.Module, ops: GgufOps | None) -> tuple[int, int]:
    """float32 on CPU: every plain nn.Linear left in the model (all of them with
    --quantization none) made row-invariant, in place. Where the kernels are built and K is a
    multiple of 32: GgufLinear of kind F32 on the weight's own storage (no copy), generated
    rows on the kernel, prompt rows on row_linear; the LM head runs the kernel for every row
    (its rows are the sampled ones, not the step's). Else RowLinear: every row on
    row_linear, slower at decode's few rows. A quantized layer routed by the step (int8)
    runs its generated rows on F32 over its dense copy, the same values. (kernel layers,
    padded layers)."""
    rows: StepRows = model.step_rows  # type: ignore[assignment]
    kernel = padded = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, SmallBatchLinear) and ops is not None and _f32able(child.dense):
                blocks = child.dense.view(torch.uint8)  # type: ignore[union-attr]
                child.generated = functools.partial(_f32_matmul, ops, blocks)
                kernel += 1
            if type(child) is not nn.Linear:
                continue
            w = child.weight.data
            if w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            head = owner is model and name == "lm_head"
            layer: nn.Module
            if ops is not None and _f32able(w):
                bias = child.bias.data if child.bias is not None else None
                layer = GgufLinear(ops, w.view(torch.uint8), "F32", None if head else w,
                                   None if head else rows, bias)  # fmt: skip
                kernel += 1
            else:
                layer = RowLinear(child)
                padded += 1
            setattr(owner, name, layer)
    return kernel, padded


def _f32_matmul(ops: GgufOps, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ops.matmul(x, blocks, "F32")


def _f32able(w: torch.Tensor | None) -> bool:
    """The F32 kind reads the float32 weight's own rows: contiguous, K a multiple of 32."""
    return w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and (
        w.dim() == 2 and w.shape[1] % BLOCK == 0 and w.is_contiguous())  # fmt: skip


# -- the model's projections and LM head from the GGUF's blocks --------------------------------
def _blocks(tensor: Any, heads: int) -> tuple[str, np.ndarray] | None:
    """(kind, (rows, row bytes) uint8) of a block-quantized GGUF tensor, rows un-permuted for
    RoPE when `heads` (as the float loader does); None for other types."""
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(tensor.tensor_type).name
    if kind not in KINDS:
        return None
    raw = np.asarray(tensor.data, dtype=np.uint8)
    if heads:
        from pdserve.common.engine.loader import _unpermute

        raw = _unpermute(raw, heads)
    return kind, raw


def _group(
    tensors: dict[str, Any], i: int, names: list[tuple[str, int]]
) -> tuple[str, np.ndarray] | None:
    """One fused projection's parts as one block matrix, if all exist with one kind."""
    parts: list[tuple[str, np.ndarray]] = []
    for name, heads in names:
        t = tensors.get(f"blk.{i}.{name}.weight")
        got = _blocks(t, heads) if t is not None else None
        if got is None or (parts and got[0] != parts[0][0]):
            return None
        parts.append(got)
    return parts[0][0], np.concatenate([p[1] for p in parts])


def quantize_gguf(model: nn.Module, path: object, cfg: Any, ops: GgufOps) -> tuple[int, bool]:
    """Replace the projections (fused qkv, o_proj, gate_up, down_proj) and the LM head by
    GgufLinear on the GGUF's blocks; (projections replaced, whether the head was)."""
    from pdserve.common.engine.quant import gguf_projections
    from pdserve.common.model.config import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}  # type: ignore[arg-type]
    rows: StepRows = model.step_rows  # type: ignore[assignment]
    replaced = 0
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr, arg-type]
        groups = gguf_projections(layer, cfg)
        for (owner, attr), names in groups.items():
            linear = getattr(owner, attr)
            got = _group(tensors, i, names)
            if not isinstance(linear, nn.Linear) or linear.bias is not None or got is None:
                continue
            kind, raw = got
            q = GgufLinear(ops, torch.from_numpy(np.ascontiguousarray(raw)), kind,
                           linear.weight.data, rows)  # fmt: skip
            assert (q.out_features, q.in_features) == tuple(linear.weight.shape)
            setattr(owner, attr, q)
            replaced += 1
    head = model.lm_head  # type: ignore[union-attr]
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    got = _blocks(t, 0) if t is not None else None
    if isinstance(head, nn.Linear) and head.bias is None and got is not None:
        raw = np.array(got[1])  # a copy: the file's map is read-only
        q = GgufLinear(ops, torch.from_numpy(raw), got[0])
        assert (q.out_features, q.in_features) == tuple(head.weight.shape)
        model.lm_head = q  # type: ignore[union-attr]
        return replaced, True
    return replaced, False


# -- the measurement behind `--quantization auto` (common/quant_choice.py runs it) ----------------
def _timed(fn: Any, repeats: int = 5) -> float:
    fn()  # warm: the OpenMP team, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(ops: GgufOps, n: int = 1536, k: int = 576, count: int = 64) -> tuple[float, float]:
    """(kernel, dense) seconds of one row through an n x k Q4_1 matrix (SmolLM2's gate/up,
    the shape of most of a small model's decode reads), each a sweep over `count` matrices
    as a decode step sweeps its layers: 35 MB of blocks and 226 MB dense, more than a
    server CPU's last-level cache, so both read memory as in a step (~0.5 s in all). Dense
    is the F32 kernel on the same weights in float32: what `--quantization none` runs a
    generated row on (f32_linears)."""
    gen = np.random.default_rng(0)
    blocks = gen.integers(0, 256, (n, k // BLOCK, BLOCK_BYTES["Q4_1"]), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)
    one = torch.from_numpy(blocks.reshape(n, -1))
    ws = [one.clone() for _ in range(count)]
    dense = [ops.dequantize(one, "Q4_1") for _ in range(count)]
    x = torch.randn(1, k)
    kernel_s = _timed(lambda: [ops.matmul(x, w, "Q4_1") for w in ws])
    dense_s = _timed(lambda: [ops.matmul(x, d.view(torch.uint8), "F32") for d in dense])
    return kernel_s / count, dense_s / count


if __name__ == "__main__":  # quant_choice.py: one JSON line, [kernel seconds, dense seconds]
    got = gguf_ops()
    if isinstance(got, str):
        raise SystemExit(got)
    print(json.dumps(measure(got[0])))
