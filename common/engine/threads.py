"""One OpenMP team per process: torch's parallel work runs on the engine thread alone.

libgomp gives every thread that opens a parallel region a team of its own, and once a
process has more such threads than CPUs it stops spinning between regions: its workers sleep
after each one and are woken with a futex for the next. A decode step is ~1,000 small
parallel regions, so it pays that wake-up ~1,000 times (a batch-1 step took nearly twice as
long once the event loop's thread had run torch too). The rule: the engine thread keeps the
node's threads (`--num-threads`); the event loop's thread and helper threads run torch ops
on one thread, so they never open a team.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch


def pin_threads(n: int) -> None:
    """This thread's torch ops use `n` threads. torch sets a thread's count from the
    process-wide one at its first parallel op, so that first happens here, then the count."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def idle_priority() -> None:
    """This thread under SCHED_IDLE (Linux; lowering needs no privilege). Threads it creates
    inherit the policy, so the OpenMP team it opens later is idle too, while the process's
    other threads (the event loop that sends first tokens and KV) keep theirs: an idle
    process would starve its own KV pushes behind the decode steps they feed (measured, 1P1D
    on 2 cores: a 6 s gap after a stream's first token)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def engine_executor(num_threads: int, idle: bool = False) -> ThreadPoolExecutor:
    """The engine thread: `num_threads` for torch (0: torch's default, the CPU count); with
    `idle`, it and its OpenMP workers under SCHED_IDLE (--engine-priority)."""
    n = num_threads or torch.get_num_threads()

    def start() -> None:
        if idle:  # before the first parallel region, which creates the team
            idle_priority()
        pin_threads(n)

    return ThreadPoolExecutor(1, "engine", initializer=start)


def helper_executor() -> ThreadPoolExecutor:
    """asyncio's default executor for the node (asyncio.to_thread): torch on one thread."""
    return ThreadPoolExecutor(thread_name_prefix="helper", initializer=pin_threads, initargs=(1,))
