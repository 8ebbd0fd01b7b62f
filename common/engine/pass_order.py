"""Which waiting prompts an on-demand prefill node runs next, and how many share a pass.

Every prompt of a prefill pass gets its first token when the pass ends, and past a few
hundred tokens a pass is compute-bound: a second long prompt in it delays the first by its
whole compute and saves only the pass's fixed cost (the weights read once, the launch).
So an on-demand node, which holds a few prompts its gateway admitted (bounded by
--max-batch / --max-batch-tokens), runs them shortest first and puts several in one pass
only up to `pass_tokens` (--prefill-pass-tokens). Measured on the sim 4P4D study
(docs/results/README.md §1): TTFT p50 at 8 req/s 283-322 ms over five runs, against
388-520 ms in arrival order with passes up to --max-batch-tokens.

Nothing starves: a prompt overtaken by later-accepted prompts totalling its own length goes
first (those in arrival order), so overtaking at most doubles its wait for compute. The
queueing baselines (round robin, JSQ) keep vLLM's order: arrival, batches up to
--max-batch-tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from pdserve.common.engine.sequence import Sequence


def shortest_first(waiting: Iterable[Sequence]) -> list[Sequence]:
    """`waiting` (in arrival order) in the order to run: the overdue in arrival order, then
    the rest by prompt length (ties in arrival order)."""
    seqs = list(waiting)
    overdue = [s for s in seqs if s.overtaken >= s.num_tokens]
    rest = sorted((s for s in seqs if s.overtaken < s.num_tokens), key=lambda s: s.num_tokens)
    return overdue + rest


def count_overtakes(waiting: Seq[Sequence], scheduled: Iterable[tuple[Sequence, int]]) -> None:
    """After a pass is formed from `waiting` (in arrival order): every prompt left out that
    arrived before one scheduled now was overtaken by that one's tokens."""
    position = {s.seq_id: i for i, s in enumerate(waiting)}
    ran = {s.seq_id: n for s, n in scheduled if s.seq_id in position}
    for i, seq in enumerate(waiting):
        if seq.seq_id not in ran:
            seq.overtaken += sum(n for rid, n in ran.items() if position[rid] > i)
