"""GGUF blocks kept quantized (common/engine/quant.py): unpacking the embedded SmolLM2's own
Q4_1 and Q8_0 tensors reproduces the GGUF's dequantization exactly, the repacked int4
kernel layout round-trips to it, and the quantized linear layers agree with float ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pdserve.common.engine.quant import (
    DENSE_FROM,
    Int4Linear,
    Int8Linear,
    Q8Linear,
    int8_per_channel,
    unpack_q4,
    unpack_q8,
)
from pdserve.common.engine.rows import StepRows, row_linear
from pdserve.common.model.config import resolve_model
from pdserve.common.model.gguf_file import GgufFile

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only


@pytest.fixture(scope="module")
def tensors():
    # the project's reader: the same names, types, shapes and bytes as gguf's GGUFReader
    # (tests/unit/test_gguf_file.py), without its ~2.3 s parse of the vocabulary's fields
    return {t.name: t for t in GgufFile(resolve_model(None).path).tensors}


def _shape(t) -> tuple[int, int]:
    cols, rows = (int(d) for d in t.shape)
    return rows, cols


def test_q4_1_blocks_unpack_to_exactly_the_gguf_dequantization(tensors):
    t = tensors["blk.0.ffn_down.weight"]
    assert GGMLQuantizationType(t.tensor_type).name == "Q4_1"
    rows, cols = _shape(t)
    q, scale, zero = unpack_q4(np.asarray(t.data), "Q4_1", rows, cols)
    assert q.min() >= 0 and q.max() <= 15
    ours = (q - 8) * np.repeat(scale, 32, axis=1) + np.repeat(zero, 32, axis=1)
    theirs = dequantize(np.asarray(t.data), GGMLQuantizationType.Q4_1).reshape(rows, cols)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())


def test_q8_0_blocks_unpack_to_exactly_the_gguf_dequantization(tensors):
    t = tensors["token_embd.weight"]
    rows, cols = _shape(t)
    q, scale = unpack_q8(np.asarray(t.data), rows, cols)
    theirs = dequantize(np.asarray(t.data), GGMLQuantizationType.Q8_0).reshape(rows, cols)
    np.testing.assert_array_equal(q * np.repeat(scale, 32, axis=1), theirs)


def test_q8_0_as_two_4_bit_planes_is_the_gguf_matrix_exactly(tensors):
    """The LM head's Q8_0 blocks through the 4-bit kernel twice (hi and lo nibbles, per-32
    scales kept): the identity through it gives back the GGUF's dequantization, bit for bit
    in float32; from DENSE_FROM rows the float weight it was given runs instead."""
    t = tensors["token_embd.weight"]
    rows, cols = _shape(t)
    q, scale = unpack_q8(np.asarray(t.data), rows, cols)
    theirs = torch.from_numpy(
        dequantize(np.asarray(t.data), GGMLQuantizationType.Q8_0).reshape(rows, cols)
    )
    head = Q8Linear(q[:4096], scale[:4096], torch.float32, theirs[:4096] * 2, dense_from=16)
    assert torch.equal(head(torch.eye(cols)[:15]).T, theirs[:4096, :15])  # the 4-bit planes
    assert torch.equal(head(torch.eye(cols)[:16]).T, 2 * theirs[:4096, :16])  # dense from 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_layout_round_trips_and_multiplies_like_the_float_weight(tensors, dtype):
    t = tensors["blk.3.attn_q.weight"]
    rows, cols = _shape(t)
    q, scale, zero = unpack_q4(np.asarray(t.data), "Q4_1", rows, cols)
    layer = Int4Linear(q, scale, zero, dtype)
    w = torch.from_numpy(
        dequantize(np.asarray(t.data), GGMLQuantizationType.Q4_1).reshape(rows, cols)
    )
    if dtype == torch.float32:  # the layout itself is exact
        torch.testing.assert_close(layer.dequantized(), w, rtol=0, atol=1e-5)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    ref = x @ w.T
    out = layer(x.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 activations
    assert (out - ref).abs().max() <= tol * ref.abs().max()


def test_int8_per_channel_linear_is_close_to_the_float_one():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    q, scale = int8_per_channel(w)
    layer = Int8Linear(q, scale, torch.float32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    ref = x @ w.T
    assert (layer(x) - ref).abs().max() <= 0.02 * ref.abs().max()


def _int_layers(tensors) -> list:
    """An int8 and an int4 layer of the same float32 weights, with their dense copies."""
    t = tensors["blk.3.attn_q.weight"]
    rows, cols = _shape(t)
    q, scale, zero = unpack_q4(np.asarray(t.data), "Q4_1", rows, cols)
    int4 = Int4Linear(q, scale, zero, torch.float32, dense_from=DENSE_FROM)
    assert int4.dense is not None
    return [int4, Int8Linear.from_float(int4.dense, torch.float32, DENSE_FROM)]


def test_torchs_int8_and_int4_kernels_rows_do_not_depend_on_the_batch_in_float32(tensors):
    """What SmallBatchLinear's float32 routing relies on: generated rows on these kernels get
    the same bits at any batch (measured on an AMD EPYC Zen 5, torch 2.13)."""
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5))
    for layer in _int_layers(tensors):
        full = layer.kernel(x)
        for m in range(1, 40):
            assert torch.equal(layer.kernel(x[:m].contiguous()), full[:m]), (type(layer), m)


@pytest.mark.parametrize("f32", [False, True], ids=["torch-kernels", "f32-kernel"])
def test_in_float32_the_step_not_the_row_count_picks_dense_or_kernel(tensors, f32):
    """A generated row alone and in a batch past DENSE_FROM rows gives the same bits (the
    row-count switch ran that batch dense: other bits); prompt rows run the padded dense.
    Where gguf_matmul.c is built (f32_linears), generated rows run its F32 kind over the
    dense copy (torch's int8 and int4 kernels take float activations 10-60x slower)."""
    from pdserve.common.engine.gguf_linear import f32_linears, gguf_ops

    x = torch.randn(2 * DENSE_FROM + 1, 576, generator=torch.Generator().manual_seed(6))
    ops = gguf_ops()
    assert not isinstance(ops, str), ops  # the suite's machines have gcc
    for layer in _int_layers(tensors):
        model = torch.nn.Module()
        model.step_rows, model.layer = StepRows(), layer  # type: ignore[assignment]
        layer.rows = step = model.step_rows  # type: ignore[assignment]
        if f32:
            assert f32_linears(model, ops[0]) == (1, 0)
            want = ops[0].matmul(x, layer.dense.view(torch.uint8), "F32")
            assert torch.equal(layer(x), want)
        alone = torch.cat([layer(x[r : r + 1]) for r in range(x.shape[0])])
        assert torch.equal(layer(x), alone), type(layer)
        step.prompt = 3
        out = layer(x)
        assert torch.equal(out[:3], row_linear(x[:3], layer.dense))
        assert torch.equal(out[3:], alone[3:])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_loaders_dequantizations_are_gguf_s_bit_for_bit(tensors, kind):
    """Both ways a node's start widens GGUF blocks, loader.dequantize_blocks (torch) and the
    C kernels' (GgufOps.widen, on the file's read-only pages as the loader passes them),
    against gguf's numpy dequantize: on random weights quantized by gguf, and on every tensor
    of that type in the embedded file (the large ones on several threads)."""
    from gguf.quants import quantize

    from pdserve.common.engine.gguf_linear import gguf_ops
    from pdserve.common.engine.loader import dequantize_blocks

    ops = gguf_ops()
    assert not isinstance(ops, str), ops  # the suite's machines have gcc
    qtype = GGMLQuantizationType[kind]
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    raws = [(quantize(x, qtype), x.shape)]
    raws += [(np.asarray(t.data), _shape(t)) for t in tensors.values() if t.tensor_type == qtype]
    torch.set_num_threads(2)
    for raw, shape in raws:
        want = dequantize(raw, qtype).reshape(-1).view(np.uint32)
        assert np.array_equal(want, dequantize_blocks(raw, kind).numpy().view(np.uint32))
        widened = ops[0].widen(raw, kind, shape)
        assert widened.shape == shape
        assert np.array_equal(want, widened.numpy().reshape(-1).view(np.uint32))
