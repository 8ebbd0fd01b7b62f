"""float32 CPU matmuls whose rows do not depend on the batch: rows padded to a row group.

The token-for-token invariant needs a row's result to be the same whichever rows share its
call. MKL's float32 matmul breaks that at few rows: one row runs a GEMV, and below 12 rows
the rows past a multiple of 4 take another path, each with other last bits (measured, torch
2.13 with MKL on an AMD EPYC Zen 5: `F.linear(x[:m], W)` differs from `F.linear(x, W)[:m]`
at m = 1, 2, 3, 5, 6, 7, 9, 10, 11). Padded with zero rows to a multiple of 4, every row
matches the big call's at every m measured: 1-300 at every layer shape of SmolLM2, up to
2,048 at two of them.

The row group is measured, not assumed: once per process, thread count and weight shape
(at load: `warm`, called by the runner; else at first use), `row_group` tries 4, 8 and 16
rows on a random matrix of the weight's shape and keeps the smallest for which every row
count up to 3 groups and a few larger ones give the rows of a 320-row call bit for bit. If
none does, a WARNING says so once and calls run unpadded.

Padding costs at few rows (1536 x 576: 52 us at one row, 155 us at four): decode rows run on
gguf_matmul.c's kernels where they build (gguf_linear.py), and this serves prompt rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

CANDIDATES = (4, 8, 16)
REFERENCE_ROWS = 320  # the big call rows are held to: a multiple of every candidate group
_groups: dict[tuple[int, int, int], int] = {}  # (threads, N, K) -> row group (1: none holds)
_warned: list[bool] = []


@dataclass
class StepRows:
    """How many of a forward's first rows are prompt tokens (LlamaModel.forward sets it)."""

    prompt: int = 0


def _applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == w.dtype == torch.float32


def padded(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """F.linear(x, w) with x's rows padded with zeros to a multiple of `group`."""
    m = x.shape[0]
    extra = -m % group
    if extra == 0:
        return F.linear(x, w)
    return F.linear(F.pad(x, (0, 0, 0, extra)), w)[:m]  # the first rows: still contiguous


def _holds(group: int, w: torch.Tensor, x: torch.Tensor, full: torch.Tensor) -> bool:
    counts = [*range(1, 3 * group + 1), 5 * group + 1, 8 * group + 3, 64, 99, 257]
    for m in counts:
        at = m % 5  # rows at other offsets than the first: their place must not matter either
        if not torch.equal(padded(x[at : at + m], w, group), full[at : at + m]):
            return False
    return True


def probe(n: int, k: int) -> int:
    """The smallest row group at which padded calls give a 320-row call's rows, or 1."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(REFERENCE_ROWS, k, generator=gen)
    full = F.linear(x, w)
    return next((g for g in CANDIDATES if _holds(g, w, x, full)), 1)


def row_group(w: torch.Tensor) -> int:
    """The row group for F.linear with this (N, K) weight on this thread count (cached)."""
    key = (torch.get_num_threads(), w.shape[0], w.shape[1])
    if key not in _groups:
        _groups[key] = probe(key[1], key[2])
        if _groups[key] == 1 and not _warned:
            _warned.append(True)
            log.warning(
                "float32 F.linear's rows depend on the batch at every row group tried %s "
                "(%d threads, %d x %d): a sequence's tokens may then depend on its batch",
                CANDIDATES, *key,
            )  # fmt: skip
    return _groups[key]


def row_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x (M, K), with rows that do not depend on M or on the other
    rows in float32 on CPU (padded to the row group); other dtypes and devices as F.linear.
    The bias is added apart: its own elementwise op, the same for every row."""
    if not _applies(x, w):
        return F.linear(x, w, bias)
    out = padded(x, w, row_group(w))
    return out if bias is None else out + bias


def by_step(
    flat: torch.Tensor,
    prompt: int,
    dense: torch.Tensor | None,
    kernel: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The first `prompt` rows on `dense` (row_linear), the others on `kernel` (given
    contiguous rows); every row on `kernel` without `dense`. Which rows are which comes from
    the step (prompt rows first), never from how many there are."""
    rows = flat.shape[0]
    prompt = min(prompt, rows)
    if dense is None or prompt == 0:
        return kernel(flat.contiguous())
    if prompt == rows:
        return row_linear(flat, dense)
    generated = kernel(flat[prompt:].contiguous())
    return torch.cat([row_linear(flat[:prompt], dense), generated])


class RowLinear(nn.Module):
    """nn.Linear on row_linear: a float32 CPU layer whose every row is padded (where the C
    kernels that run generated rows are not built, or K is not a multiple of their block)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters (tied, maybe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def warm(model: nn.Module) -> int:
    """Measure the row group of every float32 CPU weight the model's layers pad (a RowLinear's
    weight, a prompt rows' `dense`) now, at load, not in the first request (~10-40 ms a layer
    shape, ~0.8 s for SmolLM2's LM head, 2 threads); how many shapes there are."""
    shapes = set()
    for m in model.modules():
        w = m.weight if isinstance(m, RowLinear) else getattr(m, "dense", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and _applies(w, w):
            row_group(w)
            shapes.add(tuple(w.shape))
    return len(shapes)
