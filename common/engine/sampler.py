"""Token sampling: greedy, temperature, top-k, min-p, top-p, with counter-based randomness.

A sampled row draws one uniform u = counter_uniform(seed, position) and inverts the CDF of
the filtered distribution, sorted by probability (ties by token id). The draw depends only
on the logits and (seed, position), so it is the same in any batch and any process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.common.sampling import SamplingParams, counter_uniform


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[int]:
    """logits: (N, V) float32; positions: the sequence position of the token being chosen."""
    assert logits.shape[0] == len(params) == len(positions)
    greedy_tokens = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, pos) in enumerate(zip(params, positions, strict=True)):
        if p.greedy:
            out.append(int(greedy_tokens[row]))
            continue
        assert p.seed is not None, "sampled requests get a seed before they reach the engine"
        out.append(_sample_row(logits[row], p, counter_uniform(p.seed, pos)))
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        values, ids = _top_k(scaled, p.top_k)
    else:
        values, ids = torch.sort(scaled, descending=True, stable=True)
    probs = torch.softmax(values, dim=-1)
    if p.min_p > 0.0:  # sorted: the tokens at least min_p x as likely as the top one lead
        keep = max(1, int((probs >= p.min_p * probs[0]).sum().item()))
        probs, ids = probs[:keep], ids[:keep]
        probs = probs / probs.sum()  # as vLLM: top-p weighs the mass min-p left
    cdf = torch.cumsum(probs, dim=-1)
    if p.top_p < 1.0:
        # keep the smallest head whose mass reaches top_p (always at least one token)
        keep = int(torch.searchsorted(cdf, torch.tensor([p.top_p]), right=False).item()) + 1
        cdf = cdf[:keep]
        ids = ids[:keep]
    target = torch.tensor([u * float(cdf[-1])])
    index = int(torch.searchsorted(cdf, target, right=True).item())
    if index >= len(ids):  # u within 2^-25 of 1 rounds to the whole mass in float32: the
        # first token that reaches it, not the last one (of no mass: the least likely of all)
        index = int(torch.searchsorted(cdf, cdf[-1:], right=False).item())
    return int(ids[index])


def _top_k(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of the stable descending sort (ties by token id), without sorting the
    vocabulary: torch.topk leaves the order of equal values, and which of them make the
    cut, to the build (bf16 logits tie often: 24 distinct values among a top 50 seen), so a
    seeded draw could differ between nodes on other torch builds."""
    threshold = torch.topk(scaled, k).values[-1]
    above = (scaled > threshold).nonzero().squeeze(1)  # ascending ids
    at = (scaled == threshold).nonzero().squeeze(1)[: k - above.numel()]
    ids = torch.cat([above, at])
    values = scaled[ids]
    order = torch.sort(values, descending=True, stable=True).indices
    return values[order], ids[order]
