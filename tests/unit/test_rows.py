"""rows.py: float32 CPU matmuls whose rows do not depend on the batch (the token-for-token
invariant), by calls of sizes measured at first use to agree, padded with zero rows.

Plain F.linear fails the first test on an AMD EPYC Zen 5 with torch 2.13's MKL (rows of 1-3,
5-7 and 9-11 rows take other paths, other last bits); padding to a row group alone fails it
on a 2-vCPU Intel Xeon family 6 model 167 at 2 threads (the 1536 x 576 layer's calls of
49-192 rows split their work another way); with the measured sizes every row count gives
the same rows."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from pdserve.common.engine import rows
from pdserve.common.engine.rows import RowLinear, RowPlan, StepRows, by_step, row_linear

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only


def _exact(a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
    """A product whose rows never depend on the call: one row at a time. Small weights'
    plans on MKL vary by CPU and level (at the avx2 level some hold at no group): the tests
    of what row_linear does with a plan run on this, the SmolLM2 shapes below on MKL."""
    got = torch.stack([row @ b for row in a]) if a.shape[0] else a.new_empty(0, b.shape[1])
    return got if out is None else out.copy_(got)


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setattr(rows, "_mm", _exact)
    monkeypatch.setattr(rows, "_plans", {})
    return _exact


# SmolLM2-135M's linear layers (N, K): fused qkv, o_proj, fused gate_up, down_proj, LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
COUNTS = [*range(1, 41), 64, 100, 150, 300]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_rows_bits_do_not_depend_on_how_many_rows_share_the_call(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * k**-0.5
    x = torch.randn(320, k, generator=g)
    full = row_linear(x, w)
    assert rows.row_plan(w).group in rows.CANDIDATES, "no row group holds on this CPU"
    for m in COUNTS:
        got = row_linear(x[:m], w)
        assert got.shape == (m, n) and got.is_contiguous()
        assert torch.equal(got, full[:m]), m
    for at, m in ((7, 5), (3, 100), (5, 300)):  # and not on where the rows sit among them
        assert torch.equal(row_linear(x[at : at + m], w), full[at : at + m]), (at, m)


def test_the_bias_is_added_apart_and_other_dtypes_run_plain_f_linear(exact):
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(64, 96, generator=g), torch.randn(64, generator=g), torch.randn(9, 96)
    assert torch.equal(row_linear(x[:3], w, b), row_linear(x, w)[:3] + b)
    xb, wb = x.bfloat16(), w.bfloat16()  # bf16 keeps its own path (packed.py)
    assert torch.equal(row_linear(xb[:3], wb), nn.functional.linear(xb[:3], wb))


def test_no_row_group_holding_is_warned_once_and_runs_unpadded(monkeypatch, caplog):
    monkeypatch.setattr(rows, "_plans", {})
    monkeypatch.setattr(rows, "_warned", [])
    monkeypatch.setattr(rows, "_holds", lambda *a: False)  # a CPU where no padding helps
    w, x = torch.randn(32, 64), torch.randn(3, 64)
    with caplog.at_level(logging.WARNING, logger=rows.__name__):
        assert rows.row_plan(w).group == 1
        assert rows.row_plan(torch.randn(48, 64)).group == 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert torch.equal(row_linear(x, w), nn.functional.linear(x, w))


def test_prompt_rows_go_dense_and_generated_rows_to_the_kernel_by_the_step(exact):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(40, 64, generator=g), torch.randn(6, 64, generator=g)
    seen: list[int] = []

    def kernel(t: torch.Tensor) -> torch.Tensor:
        assert t.is_contiguous()
        seen.append(t.shape[0])
        return torch.zeros(t.shape[0], 40)

    out = by_step(x, 4, w, kernel)
    assert seen == [2] and torch.equal(out[:4], row_linear(x[:4], w)) and not out[4:].any()
    assert torch.equal(by_step(x, 9, w, kernel), row_linear(x, w)) and seen == [2]
    by_step(x, 4, None, kernel)  # no dense weight: every row on the kernel
    assert seen == [2, 6]


def test_row_linear_keeps_the_layers_parameters(exact):
    linear = nn.Linear(64, 24)
    layer = RowLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    x = torch.randn(2, 3, 64)
    assert torch.equal(
        layer(x), row_linear(x.reshape(6, 64), linear.weight, linear.bias).view(2, 3, 24)
    )
    assert StepRows().prompt == 0


def test_a_call_runs_as_the_calls_of_kept_sizes_costing_least():
    """The pieces costing least, a call of s rows costing s + CALL_ROWS rows, and PAD_ROWS
    more where it has more rows than there are (padded, copied out)."""
    assert (rows.CALL_ROWS, rows.PAD_ROWS) == (32, 48)  # the figures below
    plan = RowPlan(16, (16, 32, 48, 256, 512))  # 64 and 128 gave other rows: not kept
    assert plan.calls(0) == () and plan.calls(5) == ((5, 16),) and plan.calls(48) == ((48, 48),)
    assert sorted(s for _, s in plan.calls(100)) == [16, 48, 48]  # 208 against 288 for 256
    assert plan.calls(250) == ((250, 256),)
    assert sorted(s for _, s in plan.calls(1100)) == [32, 48, 512, 512]
    ladder = RowPlan(4, (4, 8, 12, 64, 128, 256, 512))
    # two whole calls (the last over the last rows) against one padded, copied out
    assert sorted(ladder.calls(240)) == [(112, 128), (128, 128)]
    assert sorted(ladder.calls(100)) == [(36, 64), (64, 64)]
    assert sorted(ladder.calls(2000)) == [(464, 512)] + [(512, 512)] * 3
    for plan in (ladder, RowPlan(16, (16, 32, 48, 256))):
        for m in range(600):
            pieces = plan.calls(m)
            assert sum(r for r, _ in pieces) == m and all(s in plan.sizes for _, s in pieces)


def test_sizes_whose_calls_split_the_work_another_way_are_not_used(monkeypatch, exact):
    """A CPU whose F.linear gives calls of 49-192 rows other last bits (the Xeon above at
    2 threads), played on any CPU: the probe drops 64 and 128, and every row count still
    gives the same rows. Padding to the group alone gave 64 rows other bits."""
    real = exact

    def split_another_way(a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
        got = real(a, b, out)
        return got.mul_(1 + 2**-20) if 49 <= a.shape[0] <= 192 else got

    monkeypatch.setattr(rows, "_mm", split_another_way)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 64, generator=g), torch.randn(400, 64, generator=g)
    plan = rows.row_plan(w)
    assert {64, 128, 192} - set(plan.sizes) == {64, 128, 192} and 256 in plan.sizes, plan
    full = row_linear(x, w)
    for m in (1, 5, 49, 64, 100, 150, 192, 193, 300):
        assert torch.equal(row_linear(x[3 : 3 + m], w), full[3 : 3 + m]), m
    assert not torch.equal(rows.padded(x[:64], w, 64), full[:64])  # what padding alone ran


def test_no_group_giving_a_big_calls_rows_falls_back_to_one_group_calls(monkeypatch, caplog, exact):
    """A CPU whose calls of 49 rows and more give other bits at each size: no group agrees
    with the big call, so a call of one group is the reference; the larger sizes
    disagree with it and are dropped (a WARNING: long prompts run as many small calls), and
    every row count still gives the same rows."""
    real = exact

    def big_calls_another_way(a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
        got = real(a, b, out)
        return got.mul_(1 + 2**-20 * (a.shape[0] // 49))  # each size its own bits from 49

    monkeypatch.setattr(rows, "_mm", big_calls_another_way)
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(40, 64, generator=g), torch.randn(200, 64, generator=g)
    with caplog.at_level(logging.WARNING, logger=rows.__name__):
        assert rows.row_plan(w) == RowPlan(4, (4, 8, 12))
    assert "many small calls" in caplog.text
    full = row_linear(x, w)
    for m in (1, 13, 49, 64, 150):
        assert torch.equal(row_linear(x[3 : 3 + m], w), full[3 : 3 + m]), m


def test_a_size_whose_whole_calls_on_views_differ_is_dropped(monkeypatch, exact):
    """Calls of a LADDER size written in place on views of the rows (whole pieces, the
    overlapping last one) are checked too, not only the padded ones."""

    def views_another_way(a: torch.Tensor, b: torch.Tensor, out: Any = None) -> torch.Tensor:
        got = exact(a, b, out)
        return got.mul_(1 + 2**-20) if out is not None and a.shape[0] == 256 else got

    monkeypatch.setattr(rows, "_mm", views_another_way)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    assert 256 not in rows.row_plan(w).sizes and 512 in rows.row_plan(w).sizes


def test_rows_keep_their_gradient():
    """Outside inference mode a layer's rows are differentiable, as F.linear's are (MKL's
    product written in place has no gradient: it raised)."""
    w = torch.randn(576, 576, requires_grad=True)  # a SmolLM2 shape: a plan holds for it
    x = torch.randn(70, 576, requires_grad=True)
    assert rows.row_plan(w).group > 1
    row_linear(x, w).sum().backward()
    assert w.grad is not None and x.grad is not None
    assert torch.allclose(x.grad, w.sum(0).expand(70, 576).detach(), rtol=1e-4, atol=1e-4)
