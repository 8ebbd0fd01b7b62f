"""bf16 weights packed once in oneDNN's layout (common/engine/packed.py): the packed product
is F.linear's bit for bit at every row count, so packing changes speed and never text; float32
and other devices are left alone; prepack swaps a model's layers and keeps their outputs.

oneDNN's bf16 linear exists only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT (and on
arm64 with BF16): pack() packs exactly where torch says that path runs, and elsewhere (an
AVX2-only CPU, or PDSERVE_CPU_ISA=avx2) returns None, prepack packs nothing and every layer
keeps F.linear. The fallback test runs on every CPU: it makes the reorder fail as it does on
such a CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pdserve.common.engine.packed import (
    PACKED_DENSE_FROM,
    PackedLinear,
    pack,
    packed_linear,
)
from pdserve.common.engine.quant import DENSE_FROM, Int4Linear, Q8Linear, prepack

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only


def _onednn_bf16() -> bool:
    """Whether oneDNN's bf16 linear runs on this CPU with this torch (its own check, which
    follows ONEDNN_MAX_CPU_ISA)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


PACKS = _onednn_bf16()
needs_packing = pytest.mark.skipif(
    not PACKS,
    reason="no oneDNN bf16 linear on this CPU: test_without_onednn_bf16_every_layer_stays_plain "
    "covers what runs instead",
)


def _packed(w: torch.Tensor) -> torch.Tensor:
    packed = pack(w)
    assert packed is not None
    return packed


def test_pack_packs_exactly_where_onednn_runs_bf16():
    assert (pack(torch.randn(64, 64).bfloat16()) is not None) == PACKS


def _model(g: torch.Generator, rows: int = 256, cols: int = 128) -> nn.Sequential:
    q = torch.randint(0, 16, (rows, cols), generator=g).numpy().astype(np.int32)
    scale = (torch.rand(rows, cols // 32, generator=g) / 10).numpy()
    zero = (torch.randn(rows, cols // 32, generator=g) / 10).numpy()
    return nn.Sequential(
        nn.Linear(cols, rows, bias=True).bfloat16(),
        Int4Linear(q, scale, zero, torch.bfloat16, dense_from=DENSE_FROM),
        nn.Linear(cols, rows, bias=False).float(),  # float32: left as it is
    )


def test_without_onednn_bf16_every_layer_stays_plain(monkeypatch):
    """An AVX2-only CPU: the reorder raises (as torch does there: "bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq"), so nothing is packed, every
    layer keeps its plain weight and the 4-bit layer its switch point, and outputs are equal."""

    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    if PACKS:  # make this CPU refuse as an AVX2-only one does
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    g = torch.Generator().manual_seed(2)
    model = _model(g)
    xs = [torch.randn(n, 128, generator=g).bfloat16() for n in (1, 8, 40)]
    before = [(model[0](x), model[1](x)) for x in xs]
    assert pack(torch.randn(8, 8).bfloat16()) is None
    assert prepack(model) == 0
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert model[1].dense is not None and model[1].dense_from == DENSE_FROM
    for x, (a, b) in zip(xs, before, strict=True):
        assert torch.equal(model[0](x), a) and torch.equal(model[1](x), b)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 37, 300])
def test_packed_product_equals_f_linear_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 576, generator=g).bfloat16()
    bias = torch.randn(384, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = _packed(w)
    assert torch.equal(packed_linear(x, packed, None), nn.functional.linear(x, w))
    assert torch.equal(packed_linear(x, packed, bias), nn.functional.linear(x, w, bias))
    # a row's result does not depend on the rows beside it
    assert torch.equal(packed_linear(x[:1], packed, None)[0], packed_linear(x, packed, None)[0])


def test_float32_and_odd_shapes_stay_plain():
    assert pack(torch.randn(64, 64)) is None  # oneDNN's fp32 kernel differs from F.linear
    assert pack(torch.randn(64).bfloat16()) is None


@needs_packing
def test_prepack_swaps_linears_and_keeps_every_output():
    g = torch.Generator().manual_seed(0)
    rows, cols = 256, 128
    model = _model(g, rows, cols)
    xs = {n: torch.randn(n, cols, generator=g).bfloat16() for n in (1, 4, 8, 16, 40)}
    before = {n: (model[0](x), model[1](x)) for n, x in xs.items()}
    dense = model[1].dense
    assert prepack(model) == 2
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear
    assert model[1].dense is None and model[1].packed_dense is not None
    assert model[1].dense_from == PACKED_DENSE_FROM
    for n, x in xs.items():
        assert torch.equal(model[0](x), before[n][0])
        if n >= DENSE_FROM or n < PACKED_DENSE_FROM:  # the same path as before packing
            assert torch.equal(model[1](x), before[n][1])
        else:  # now dense where the 4-bit kernel ran: the same weights, a product's rounding
            assert torch.equal(model[1](x), nn.functional.linear(x, dense))
    out = model[0](xs[4].view(2, 2, cols))  # leading dims are kept
    assert out.shape == (2, 2, rows)


@needs_packing
def test_a_q8_head_tied_to_the_embedding_keeps_the_embedding_weight():
    g = torch.Generator().manual_seed(1)
    emb = nn.Embedding(512, 64).bfloat16()
    q = torch.randint(-127, 128, (512, 64), generator=g).numpy().astype(np.int8)
    scale = (torch.rand(512, 2, generator=g) / 100).numpy().astype(np.float32)
    head = Q8Linear(q, scale, torch.bfloat16, emb.weight.data, DENSE_FROM)
    model = nn.ModuleDict({"emb": emb, "head": head})
    x = torch.randn(20, 64, generator=g).bfloat16()
    want = nn.functional.linear(x, emb.weight.data)
    assert prepack(model) == 1
    assert torch.equal(head(x), want)
    assert emb.weight.data.dtype == torch.bfloat16 and emb(torch.tensor([3])).shape == (1, 64)
