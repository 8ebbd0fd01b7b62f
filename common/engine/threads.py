"""One OpenMP team per process: torch's parallel work runs on the engine thread alone.

libgomp gives every thread that opens a parallel region a team of its own, and once a
process has more such threads than CPUs it stops spinning between regions: its workers sleep
after each one and are woken with a futex for the next. A decode step is ~1,000 small
parallel regions, so it pays that wake-up ~1,000 times. Measured on the 2-vCPU box (SmolLM2,
bf16 + int4, batch-1 decode on 2 threads): 16.4 ms a step on the thread that did all torch
work, 28 ms on a node's engine thread after the main thread had run torch too (the node's
real ITL was 31 ms), 16.9 ms under this module's rule, also after helper threads copied
32 MB. The rule: the engine thread keeps the node's threads (`--num-threads`); the event
loop's thread and helper threads run torch ops on one thread, so they never open a team.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def pin_threads(n: int) -> None:
    """This thread's torch ops use `n` threads. torch sets a thread's count from the
    process-wide one at its first parallel op, so that first happens here, then the count."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def engine_executor(num_threads: int) -> ThreadPoolExecutor:
    """The engine thread: `num_threads` for torch (0: torch's default, the CPU count)."""
    n = num_threads or torch.get_num_threads()
    return ThreadPoolExecutor(1, "engine", initializer=pin_threads, initargs=(n,))


def helper_executor() -> ThreadPoolExecutor:
    """asyncio's default executor for the node (asyncio.to_thread): torch on one thread."""
    return ThreadPoolExecutor(thread_name_prefix="helper", initializer=pin_threads, initargs=(1,))
