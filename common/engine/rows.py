"""float32 CPU matmuls whose rows do not depend on the batch: calls of measured sizes only.

The token-for-token invariant needs a row's result to be the same whichever rows share its
call. MKL's float32 matmul breaks that in two ways. At few rows a row takes another kernel:
one row runs a GEMV, and below 12 rows the rows past a multiple of 4 take another path, each
with other last bits (torch 2.13 with MKL on an AMD EPYC Zen 5: `F.linear(x[:m], W)` differs
from `F.linear(x, W)[:m]` at m = 1, 2, 3, 5, 6, 7, 9, 10, 11); padding with zero rows to a
multiple of a row group mends that. And on two threads MKL splits some calls' work another
way by their size: on a 2-vCPU Intel Xeon (family 6 model 167, AVX-512, AMX) SmolLM2's
1536 x 576 down projection gives other bits for every call of 49-192 rows, padded or not,
than for calls of up to 48 or from 193 rows.

So a call's rows go to F.linear only in calls of sizes measured to agree (`RowPlan`): once
per process, thread count and weight shape (at load: `warm`, called by the runner; else at
first use), `probe` takes the smallest row group of CANDIDATES at which calls of 1-3
groups, padded, give a 516-row call's rows, then keeps each of LADDER's larger sizes that
gives them too. If no group's calls give the big call's rows, a row's result from a call
of one group is the reference instead (then few LADDER sizes agree, if any: a long prompt
runs as many small calls, and a WARNING says so). A call of m rows runs as the calls of
kept sizes that cost least, the last a whole call over the last rows (or padded). If no
group holds at all, a WARNING says so once and calls run unpadded. What a call's bits
depend on is taken to be its size, not its rows' values or where they sit: each size is
checked at a row off a group's start, whole (on a view of x's rows, into a view of the
output) and one row short (padded); a short last piece overlaps the one before only where
K and N are multiples of 16 (views of rows start 64-byte aligned as fresh tensors do).

Padding costs at few rows (1536 x 576: 52 us at one row, 155 us at four): decode rows run on
gguf_matmul.c's kernels where they build (gguf_linear.py), and this serves prompt rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# row groups tried, smallest first; 32 and 64 for MKL's AVX2 kernels (held to AVX2 on the
# Xeon below, calls of up to 32 rows gave other bits at each offset, from 48-64 rows none)
CANDIDATES = (4, 8, 16, 32, 64)
LADDER = (64, 128, 192, 256, 384, 512)  # larger call sizes tried: a prompt's rows in few calls
_plans: dict[tuple[int, int, int], RowPlan] = {}  # (threads, N, K) -> its plan
_warned: list[bool] = []


@dataclass(frozen=True)
class RowPlan:
    """The call sizes (multiples of `group`, ascending) whose rows agree; group 1: none."""

    group: int
    sizes: tuple[int, ...]

    def calls(self, m: int) -> tuple[tuple[int, int], ...]:
        """m rows as (rows, call size) pieces, the last maybe padded with zero rows."""
        return _pieces(self.sizes, m)


# what a call costs beyond its rows, in rows: the weight read again, the threads started
# (SmolLM2's layers on a 2-vCPU Intel Xeon, 2 threads: a 12-row call ~2.5x its share of a
# 100-row one)
CALL_ROWS = 32
# and a short piece no whole call over the last rows can cover (the call has more rows than
# there are): x padded, its rows copied out (~0.2 ms at 960 x 576, 500 rows: ~55 rows' work)
PAD_ROWS = 48


@functools.lru_cache(maxsize=4096)
def _pieces(sizes: tuple[int, ...], m: int) -> tuple[tuple[int, int], ...]:
    """The pieces costing least, a call of s rows costing s + CALL_ROWS (a zero row as much
    as a real one): calls of the largest size first, the last sizes' worth chosen."""
    top = sizes[-1]
    lead = max(0, m // top - len(sizes))
    rest = m - lead * top
    cost, pick = [0] * (rest + 1), [0] * (rest + 1)
    for r in range(1, rest + 1):
        cost[r], pick[r] = min(
            (s + CALL_ROWS + (PAD_ROWS if s > m else 0) + cost[max(0, r - s)], s) for s in sizes
        )
    out = [(top, top)] * lead
    while rest > 0:
        out.append((min(pick[rest], rest), pick[rest]))
        rest -= out[-1][0]
    return tuple(out)


@dataclass
class StepRows:
    """How many of a forward's first rows are prompt tokens (LlamaModel.forward sets it)."""

    prompt: int = 0


def _applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == w.dtype == torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def _one(x: torch.Tensor, w: torch.Tensor, size: int) -> torch.Tensor:
    """x @ w.T in one call of `size` rows (x padded with zero rows): a view of its rows."""
    m = x.shape[0]
    return _mm(F.pad(x, (0, 0, 0, size - m)) if size > m else x, w.t())[:m]


def _call(x: torch.Tensor, w: torch.Tensor, size: int, out: torch.Tensor) -> None:
    """x @ w.T into `out` (x's rows), in one call of `size` rows: x padded with zero rows."""
    if x.shape[0] == size:
        _mm(x, w.t(), out)  # F.linear's product, written in place: no copy after
    else:
        out.copy_(_one(x, w, size))


def padded(x: torch.Tensor, w: torch.Tensor, size: int, at: int = 0) -> torch.Tensor:
    """x @ w.T in one call of `size` rows, written `at` rows into a new output."""
    out = x.new_empty(at + x.shape[0], w.shape[0])[at:]
    _call(x, w, size, out)
    return out


def _agrees(size: int, w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> bool:
    """Calls of `size` rows, full and one row short (padded), at rows off a group's start,
    give the reference's rows."""
    for m in {size, size - 1} - {0}:
        at = 1 + m % 3  # rows at other offsets than the first: their place must not matter
        if not torch.equal(padded(x[at : at + m], w, size, at), ref[at : at + m]):
            return False
    return True


def _reference(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    return torch.cat([padded(c, w, group) for c in x.split(group)])


def _holds(group: int, w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> bool:
    return all(_agrees(s, w, x, ref) for s in (group, 2 * group, 3 * group)) and torch.equal(
        padded(x[2:3], w, group), ref[2:3]
    )  # and one row among zeros


def probe(n: int, k: int) -> RowPlan:
    """The smallest row group whose calls give a big call's rows and the LADDER sizes that
    do too; failing that, the smallest whose calls agree with its own one-group calls."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(max(LADDER) + 4, k, generator=gen)
    big = _mm(x, w.t())
    return (
        _plan(w, x, lambda group, rows: big[:rows])
        # each row from a call of one group at a group's start, the rows a check needs
        # first (a large N reads its whole weight at every call)
        or _plan(w, x, lambda group, rows: _reference(x[:rows], w, group))
        or RowPlan(1, (1,))
    )


def _plan(
    w: torch.Tensor, x: torch.Tensor, reference: Callable[[int, int], torch.Tensor]
) -> RowPlan | None:
    for group in CANDIDATES:
        if _holds(group, w, x, reference(group, 4 * group)):
            ref = reference(group, x.shape[0])
            own = (group, 2 * group, 3 * group)
            kept = [s for s in LADDER if s % group == 0 and s not in own and _agrees(s, w, x, ref)]
            return RowPlan(group, tuple(sorted({*own, *kept})))
    return None


def row_plan(w: torch.Tensor) -> RowPlan:
    """The plan for F.linear with this (N, K) weight on this thread count (cached)."""
    key = (torch.get_num_threads(), w.shape[0], w.shape[1])
    if key not in _plans:
        plan = _plans[key] = probe(key[1], key[2])
        if plan.group == 1:
            if not _warned:
                _warned.append(True)
                log.warning(
                    "float32 F.linear's rows depend on the batch at every row group tried %s "
                    "(%d threads, %d x %d): a sequence's tokens may then depend on its batch",
                    CANDIDATES, *key,
                )  # fmt: skip
        elif plan.sizes[-1] < LADDER[0]:
            log.warning(
                "float32 F.linear (%d threads, %d x %d) agrees across the batch only in calls "
                "of up to %d rows: a long prompt runs as many small calls",
                *key, plan.sizes[-1],
            )  # fmt: skip
        else:
            log.debug("float32 rows (%d threads, %d x %d): %s", *key, plan)
    return _plans[key]


def row_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x (M, K), with rows that do not depend on M or on the other
    rows in float32 on CPU (calls of the plan's sizes); other dtypes and devices as F.linear.
    The bias is added apart: its own elementwise op, the same for every row."""
    if not _applies(x, w):
        return F.linear(x, w, bias)
    plan = row_plan(w)
    if plan.group == 1 or x.shape[0] == 0:
        out = F.linear(x, w)
    elif torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        # writes in place have no gradient: the pieces apart, joined (as F.linear, with one)
        parts, at = [], 0
        for m, size in plan.calls(x.shape[0]):
            parts.append(_one(x[at : at + m], w, size))
            at += m
        out = torch.cat(parts)
    else:
        calls = plan.calls(x.shape[0])
        # one call: its output's rows, a view (no copy out)
        out = _one(x, w, calls[0][1]) if len(calls) == 1 else _in_place(x, w, plan)
    return out if bias is None else out + bias


def _in_place(x: torch.Tensor, w: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    rows = x.shape[0]
    out, at = x.new_empty(rows, w.shape[0]), 0
    aligned = x.shape[1] % 16 == 0 and w.shape[0] % 16 == 0  # a view's rows: 64-byte aligned
    for m, size in plan.calls(rows):
        if m < size <= rows and aligned:  # the last piece, short: a whole call over the last
            _call(x[rows - size :], w, size, out[rows - size :])  # rows (rewrites equal bits)
        else:
            _call(x[at : at + m], w, size, out[at : at + m])
        at += m
    return out


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
    """Measure the row plan of every float32 CPU weight the model's layers pad (a RowLinear's
    weight, a prompt rows' `dense`) now, at load, not in the first request (SmolLM2 on a
    2-vCPU Intel Xeon, 2 threads: 30-240 ms a layer shape, 1.2 s for the LM head, which
    runs here only where the C kernels are not built); how many shapes there are."""
    shapes = set()
    for m in model.modules():
        w = m.weight if isinstance(m, RowLinear) else getattr(m, "dense", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and _applies(w, w):
            row_plan(w)
            shapes.add(tuple(w.shape))
    return len(shapes)
