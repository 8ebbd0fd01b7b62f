"""gguf_matmul.c (through gguf_linear.py): GGUF's Q4_0, Q4_1 and Q8_0 blocks and dense
float32 weights (F32) times float32 activations, against gguf's own dequantization and a
float64 matmul; rows independent of the batch; the prompt / generated row split; a model's
float32 layers moved onto F32; auto's choice from injected timings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pdserve.common import quant_choice
from pdserve.common.engine import gguf_linear as gl
from pdserve.common.engine.gguf_linear import gguf_ops
from pdserve.common.engine.loader import dequantize_blocks
from pdserve.common.engine.rows import RowLinear, StepRows, row_linear

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only

KINDS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="module")
def ops() -> gl.GgufOps:
    got = gguf_ops()
    if isinstance(got, str):  # the suite's machines have gcc: this would be a real failure
        pytest.fail(f"gguf kernels do not build: {got}")
    return got[0]


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, k / 32, block bytes) uint8: random quants, scales of a real model's size and of
    both signs (llama.cpp's Q4_0 and Q8_0 scales take either; a negative one makes a zero
    weight -0), a subnormal half among them, Q4_1 mins of both signs. F32: normal floats of a
    layer's scale, a -0 and a subnormal among them."""
    gen = np.random.default_rng(seed)
    if kind == "F32":
        w = (gen.standard_normal((n, k)) * k**-0.5).astype(np.float32)
        w.flat[0], w.flat[-1] = np.float32(-0.0), np.float32(1e-40)
        return w.view(np.uint8).reshape(n, k // 32, 128)
    blocks = gen.integers(0, 256, (n, k // 32, gl.BLOCK_BYTES[kind]), dtype=np.uint8)
    sign = np.where(gen.random((n, k // 32)) < 0.5, -1.0, 1.0) if kind != "Q4_1" else 1.0
    d = (sign * gen.uniform(0.001, 0.05, (n, k // 32))).astype(np.float16)
    d.flat[0] = np.float16(3e-6)  # subnormal in half precision
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    if kind == "Q4_1":
        m = gen.uniform(-0.2, 0.2, (n, k // 32)).astype(np.float16)
        blocks[..., 2:4] = m[..., None].view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", KINDS)
def test_widened_weights_equal_ggufs_dequantization_bit_for_bit(ops, kind):
    blocks = random_blocks(kind, 37, 96)
    ours = ops.dequantize(torch.from_numpy(blocks.reshape(37, -1)), kind)
    theirs = dequantize_blocks(blocks.reshape(-1), kind).reshape(37, 96)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # -0 is not +0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 96), (577, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
def test_kernel_equals_the_dequantized_product(ops, kind, n, k, rows):
    blocks = torch.from_numpy(random_blocks(kind, n, k).reshape(n, -1))
    w = ops.dequantize(blocks, kind).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n + k + rows))
    got = ops.matmul(x, blocks, kind).double()
    exact = x.double() @ w.T
    # float32 sums of k products, in any order: |error| <= k * 2^-24 * sum |w x| (Higham's
    # bound, first order); the products are exact enough that this is the whole error
    bound = k * 2.0**-24 * (x.double().abs() @ w.abs().T) + 1e-30
    assert got.shape == (rows, n)
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_batch(ops, kind):
    """The token-for-token invariant: row r alone, or anywhere in batches of any size, gives
    the same bits (rows go in pairs through the kernel, a last odd row alone)."""
    blocks = torch.from_numpy(random_blocks(kind, 129, 576).reshape(129, -1))
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([ops.matmul(x[r : r + 1], blocks, kind) for r in range(9)])
    for size in (2, 3, 5, 9):
        batched = torch.cat([ops.matmul(x[i : i + size], blocks, kind) for i in range(0, 9, size)])
        assert torch.equal(batched, alone), size


def test_a_k_the_blocks_cannot_tile_is_refused(ops):
    blocks = torch.from_numpy(random_blocks("Q4_1", 4, 64).reshape(4, -1))
    with pytest.raises(AssertionError):
        ops.matmul(torch.randn(1, 48), blocks, "Q4_1")
    with pytest.raises(AssertionError):  # F32's blocks are 32 floats too
        ops.matmul(torch.randn(1, 48), torch.randn(4, 48).view(torch.uint8), "F32")


def test_prompt_rows_run_dense_and_generated_rows_the_blocks(ops):
    kind, n, k = "Q4_1", 96, 128
    blocks = torch.from_numpy(random_blocks(kind, n, k).reshape(n, -1))
    dense = ops.dequantize(blocks, kind)
    step = gl.StepRows()
    layer = gl.GgufLinear(ops, blocks, kind, dense, step)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2))
    for prompt in (0, 3, 7, 9):  # none, some, all (and a count past the rows) prompt rows
        step.prompt = prompt
        out = layer(x)
        p = min(prompt, 7)
        assert torch.equal(out[:p], row_linear(x[:p], dense))  # padded: rows.py
        assert torch.equal(out[p:], ops.matmul(x[p:].contiguous(), blocks, kind))
    head = gl.GgufLinear(ops, blocks, kind)  # no dense weight: every row on the blocks
    step.prompt = 7
    assert torch.equal(head(x), ops.matmul(x, blocks, kind))


def f32_blocks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w (n, k) float32, its bytes (n, 4k) uint8: the same storage)."""
    w = torch.from_numpy(random_blocks("F32", n, k, seed).reshape(n, k * 4)).view(torch.float32)
    return w, w.view(torch.uint8)


@pytest.mark.parametrize(("n", "k"), [(1, 32), (37, 96), (577, 576), (960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
def test_f32_kernel_is_within_float32_summation_error_of_the_float64_product(ops, n, k, rows):
    w, blocks = f32_blocks(n, k, seed=rows)
    assert torch.equal(ops.dequantize(blocks, "F32").view(torch.int32), w.view(torch.int32))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n + k + rows))
    got = ops.matmul(x, blocks, "F32").double()
    exact = x.double() @ w.double().T
    # Each output is 16 lane sums of k / 16 products in block order (a fused multiply-add:
    # the product exact, one rounding per step; the portable loop rounds the product too),
    # then a 4-level fold: every term goes through at most m = k / 16 + 5 roundings, each a
    # factor (1 + d), |d| <= u = 2^-24 (float32's unit roundoff, eps / 2). So (Higham, 3.1)
    # |got - exact| <= gamma_m * sum |w x|, gamma_m = m u / (1 - m u); the float64
    # reference's own error (~k * 2^-53 of the same sum) is far below it.
    m = k // 16 + 5
    u = 2.0**-24
    bound = m * u / (1 - m * u) * (x.double().abs() @ w.double().abs().T) + 1e-40
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())


def test_f32_kernels_rows_are_the_same_bits_at_every_batch(ops):
    """A row alone or among 2, 4, 7 or 16 (the 4-, 2- and 1-row tiles in every mix)."""
    _, blocks = f32_blocks(577, 576)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([ops.matmul(x[r : r + 1], blocks, "F32") for r in range(16)])
    for size in (2, 4, 7, 16):
        batched = torch.cat(
            [ops.matmul(x[i : i + size], blocks, "F32") for i in range(0, 16, size)]
        )
        assert torch.equal(batched, alone), size


class _Tiny(torch.nn.Module):
    """A model's linear layers as f32_linears finds them: in children, and the LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.step_rows = StepRows()
        self.mlp = torch.nn.ModuleDict({"up": torch.nn.Linear(64, 96, bias=False),
                                        "odd": torch.nn.Linear(48, 64, bias=False),
                                        "qkv": torch.nn.Linear(64, 32)})  # fmt: skip
        self.lm_head = torch.nn.Linear(64, 200, bias=False)


def test_f32_linears_run_generated_rows_on_the_weights_own_storage(ops):
    model = _Tiny()
    layers = {name: getattr(model.mlp, name) for name in ("up", "odd", "qkv")}
    assert gl.f32_linears(model, ops) == (3, 1)
    up, odd, qkv, head = model.mlp.up, model.mlp.odd, model.mlp.qkv, model.lm_head
    assert isinstance(up, gl.GgufLinear) and up.kind == "F32" and up.rows is model.step_rows
    assert up.blocks.data_ptr() == layers["up"].weight.data_ptr()  # no copy
    assert isinstance(odd, RowLinear)  # K = 48: no whole blocks of 32
    assert isinstance(head, gl.GgufLinear) and head.rows is None  # every row on the kernel
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    model.step_rows.prompt = 2
    w, b = layers["qkv"].weight.data, layers["qkv"].bias.data
    out = qkv(x)
    assert torch.equal(out[:2], row_linear(x[:2], w) + b)
    assert torch.equal(out[2:], ops.matmul(x[2:].contiguous(), w.view(torch.uint8), "F32") + b)
    assert torch.equal(head(x), ops.matmul(x, head.blocks, "F32"))
    plain = _Tiny()  # without the kernels: every layer on padded F.linear
    assert gl.f32_linears(plain, None) == (0, 4)
    assert all(isinstance(m, RowLinear) for m in (*plain.mlp.values(), plain.lm_head))


def test_auto_picks_the_kernel_only_by_a_clear_margin(tmp_path, monkeypatch):
    assert quant_choice.kernel_pays(50e-6, 230e-6)
    assert not quant_choice.kernel_pays(95e-6, 100e-6)  # within the noise: stay dense
    assert not quant_choice.kernel_pays(300e-6, 100e-6)
    # the cached measurement decides, per kernel build: injected timings
    (tmp_path / "gguf-choice-fast.json").write_text(json.dumps([40e-6, 200e-6]))
    (tmp_path / "gguf-choice-slow.json").write_text(json.dumps([400e-6, 200e-6]))
    assert quant_choice.choice("fast", tmp_path)[0]
    assert not quant_choice.choice("slow", tmp_path)[0]
    # none cached: measured in a child process (both sides real), written for the next start
    # (even on a CPU this suite's other work starves: what is kept is the next test's)
    monkeypatch.setattr(quant_choice, "starved", lambda kernel_s, dense_s: False)
    pays, why = quant_choice.choice("new", tmp_path)
    kernel_s, dense_s = json.loads((tmp_path / "gguf-choice-new.json").read_text())
    assert pays == quant_choice.kernel_pays(kernel_s, dense_s) and "dense float32" in why
    assert 0 < kernel_s < 0.01 and 0 < dense_s < 0.01  # seconds for one 1536 x 576 row


def test_a_measurement_on_a_starved_cpu_decides_once_and_is_not_kept(tmp_path, monkeypatch):
    """Taken under a CPU quota both sides read 8.0 ms a row (0.44 GB/s dense): cached, that
    decided every later start on the machine, quiet or not."""
    monkeypatch.setattr(quant_choice, "_measured", lambda: (8.0e-3, 8.0e-3))
    assert quant_choice.choice("busy", tmp_path)[0] is False
    assert not (tmp_path / "gguf-choice-busy.json").exists()
    (tmp_path / "gguf-choice-old.json").write_text(json.dumps([8.0e-3, 8.0e-3]))  # kept before
    monkeypatch.setattr(quant_choice, "_measured", lambda: (80e-6, 200e-6))  # a quiet CPU
    assert quant_choice.choice("old", tmp_path)[0] is True
    assert json.loads((tmp_path / "gguf-choice-old.json").read_text()) == [80e-6, 200e-6]
    # the kernel's threads starved (an image build beside other work): 2,496 us against 146
    monkeypatch.setattr(quant_choice, "_measured", lambda: (2496e-6, 146e-6))
    assert quant_choice.choice("build", tmp_path)[0] is False
    assert not (tmp_path / "gguf-choice-build.json").exists()
