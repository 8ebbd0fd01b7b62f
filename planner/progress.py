"""`pdserve plan`'s progress on stderr: each simulation in flight with a bar of its requests
done, how many splits were simulated, and the best so far. On a terminal one line redrawn
in place (from a thread, twice a second); otherwise a line per finished simulation."""

from __future__ import annotations

import os
import threading
import time
from typing import TextIO

from pdserve.planner.candidate import Candidate
from pdserve.planner.pool import Pool

BAR = 10
REDRAW_S = 0.5


def cores() -> int:
    """The cores this process may run on (simulations in parallel)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def bar(share: float) -> str:
    full = min(BAR, max(0, int(share * BAR)))
    return "#" * full + "." * (BAR - full)


class Progress:
    def __init__(self, out: TextIO, start: float) -> None:
        self.out, self.start = out, start
        self.tty = out.isatty()
        self.best: Candidate | None = None
        self.pool: Pool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.tty:
            self._thread = threading.Thread(target=self._redraw, daemon=True)
            self._thread.start()

    def __call__(self, pool: Pool, finished: Candidate | None) -> None:
        """A simulation was started (finished None) or ended."""
        self.pool = pool
        if finished is not None and (self.best is None or finished.key() < self.best.key()):
            self.best = finished
        if finished is not None and not self.tty:
            c = finished
            print(
                f"[{time.perf_counter() - self.start:7.1f} s] {c.name} --max-batch "
                f"{c.cfg.prefill_max_batch}: {c.goodput_per_node:.4f} req/s per node, "
                f"{c.attainment:.1%} within SLO ({c.seconds:.1f} s); {self._best()}",
                file=self.out,
                flush=True,
            )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            print(file=self.out, flush=True)

    def _best(self) -> str:
        b = self.best
        if b is None:
            return "best: none yet"
        return f"best {b.name}: {b.goodput_per_node:.4f} per node, {b.attainment:.1%}"

    def _redraw(self) -> None:
        while not self._stop.wait(REDRAW_S):
            pool = self.pool
            if pool is None:
                continue
            flight = "  ".join(f"{name} [{bar(share)}]" for name, share in pool.running())
            line = (
                f"{time.perf_counter() - self.start:6.1f} s  {pool.done} simulated  "
                f"{flight}  | {self._best()}"
            )
            self.out.write("\r" + line[:160].ljust(160))
            self.out.flush()
