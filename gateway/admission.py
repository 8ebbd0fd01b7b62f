"""Admission order: which waiting request makes offers first (`--admission`). Pure: the
placer (gateway/placement.py) passes what it knows of each waiting request and the time.

Every waiting request may take capacity that fits it; the order only decides who asks first
in a placement round, so a request no node can take yet (a long prompt while every batch is
busy) never blocks the short ones behind it.

    fifo      arrival order
    spf       shortest estimated prefill first, aged: each second waited counts as `aging`
              seconds of prefill less, so a long prompt's turn comes
    deadline  earliest TTFT deadline first (arrival + `--ttft-slo`) among requests that can
              still meet it; a request that cannot yields to those that can, and is served
              after them in arrival order

Two rules come before any order, so nothing starves: a request re-placed mid-stream (its
node died or preempted it; its user watches a stalled stream) goes first, and so does any
request that has waited `max_wait` seconds or more, oldest first. Such a request, if the
nodes reject it for lack of room, has one of them kept free until it fits (the placer's
`_reserve`), so its wait is bounded by `max_wait` plus the time that node takes to finish its
batch and place the urgent requests before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

ORDERS = ("fifo", "spf", "deadline")


@dataclass(frozen=True)
class Waiting:
    key: int  # arrival sequence number (ties)
    arrived: float  # monotonic seconds
    prefill_s: float  # estimated prefill time of the tokens it needs computed
    deadline: float = math.inf  # when its first token is due (arrival + TTFT SLO)
    resumed: bool = False  # re-placed mid-stream


def can_meet(w: Waiting, now: float) -> bool:
    return now + w.prefill_s <= w.deadline


def urgent(w: Waiting, now: float, max_wait: float) -> bool:
    """Re-placed mid-stream, or waited `max_wait`: goes first, and keeps a node for itself
    while nothing has room for it (gateway/placement.py)."""
    return w.resumed or now - w.arrived >= max_wait


def order(
    policy: str, waiting: Sequence[Waiting], now: float, max_wait: float, aging: float = 1.0
) -> list[Waiting]:
    """`waiting` in the order its requests make offers."""
    if policy not in ORDERS:
        raise ValueError(f"unknown admission order {policy!r}: choose one of {ORDERS}")

    first = sorted(
        (w for w in waiting if urgent(w, now, max_wait)), key=lambda w: (not w.resumed, w.key)
    )
    rest = [w for w in waiting if not urgent(w, now, max_wait)]
    if policy == "fifo":
        rest.sort(key=lambda w: w.key)
    elif policy == "spf":
        rest.sort(key=lambda w: (w.prefill_s - aging * (now - w.arrived), w.key))
    else:
        rest.sort(key=lambda w: (0, w.deadline, w.key) if can_meet(w, now) else (1, 0.0, w.key))
    return first + rest


def keep_for(
    kept: str | None,
    refused: Collection[str],
    room: dict[str, int],
    capacity: Callable[[str], int],
    tokens: int,
) -> str | None:
    """The node an urgent request that found no room keeps from taking anything else (its
    room set to 0), this round and every round after until the request is placed: that
    node's batch drains and the request fits. Without it, requests that fit would take every
    freed slot first and a long prompt could wait forever. The node kept before while it
    still refuses (in `refused`, this round's), else the refusing node that said it had most
    room, among those whose cache (`capacity`, in tokens) could ever hold `tokens`; None:
    no such node (a request with nothing to offer keeps nothing from the others)."""
    if kept not in refused:
        able = [n for n in refused if capacity(n) >= tokens]
        kept = max(able, key=lambda n: (room.get(n, 0), n), default=None)
    if kept is not None:
        room[kept] = 0
    return kept
