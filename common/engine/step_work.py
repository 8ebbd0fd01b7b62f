"""What the engine computes for a step the scheduler chose (scheduler.py): the seam between
the pure policy and the engine's interface (interface.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.engine.interface import DecodeWork, PrefillWork

if TYPE_CHECKING:
    from pdserve.common.engine.scheduler import SchedulerOutput


def step_work(out: SchedulerOutput) -> tuple[list[PrefillWork], list[DecodeWork]]:
    """What the engine computes for a scheduled step: each prefill chunk (sampling only at a
    prompt's last chunk) and each decode token."""
    prefills = []
    for seq, n in out.prefills:
        start = seq.num_computed_tokens
        last = start + n == seq.num_tokens
        prefills.append(
            PrefillWork(
                seq.seq_id,
                seq.token_ids[start : start + n],
                start,
                seq.block_table,
                seq.params if last else None,
            )
        )
    decodes = [
        DecodeWork(s.seq_id, s.token_ids[-1], s.num_tokens - 1, list(s.block_table), s.params)
        for s in out.decodes
    ]
    return prefills, decodes
