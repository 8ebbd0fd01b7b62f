"""bf16 weights packed once in oneDNN's layout (common/engine/packed.py): the packed product
is F.linear's bit for bit at every row count, so packing changes speed and never text; float32
and other devices are left alone; prepack swaps a model's layers and keeps their outputs."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from torch import nn

from pdserve.common.engine.packed import (
    PACKED_DENSE_FROM,
    PackedLinear,
    pack,
    packed_linear,
    prepack,
)
from pdserve.common.engine.quant import DENSE_FROM, Int4Linear, Q8Linear

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _packed(w: torch.Tensor) -> torch.Tensor:
    packed = pack(w)
    if packed is None:  # x86 wheels of torch carry oneDNN; elsewhere the path may be absent
        assert not X86, "oneDNN packing unavailable on x86_64"
        pytest.skip("this torch build has no oneDNN bf16 linear")
    return packed


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


def test_prepack_swaps_linears_and_keeps_every_output():
    _packed(torch.randn(8, 8).bfloat16())
    g = torch.Generator().manual_seed(0)
    rows, cols = 256, 128
    q = torch.randint(0, 16, (rows, cols), generator=g).numpy().astype(np.int32)
    scale = (torch.rand(rows, cols // 32, generator=g) / 10).numpy()
    zero = (torch.randn(rows, cols // 32, generator=g) / 10).numpy()
    model = nn.Sequential(
        nn.Linear(cols, rows, bias=True).bfloat16(),
        Int4Linear(q, scale, zero, torch.bfloat16, dense_from=DENSE_FROM),
        nn.Linear(cols, rows, bias=False).float(),  # float32: left as it is
    )
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


def test_a_q8_head_tied_to_the_embedding_keeps_the_embedding_weight():
    _packed(torch.randn(8, 8).bfloat16())
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
