"""One thread working through the paths handed to it, oldest first: the disk tier's writes
(common/engine/tier_writer.py) and reads ahead (tier_reader.py). The work runs outside the
lock; what it found is recorded under it (`done`), and whatever `done` returns is called
after, outside it (a wake-up). An exception in the work, in `done` or in what it returns is
logged, never the thread's end: the blocks waiting on it would wait for good."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
Done = Callable[[Path, Any, Any], Callable[[], object] | None]  # (path, item, result)


class PathQueue:
    def __init__(self, name: str, work: Callable[[Path, Any], Any], done: Done) -> None:
        self.name, self.work, self.done = name, work, done
        self.cond = threading.Condition()  # its owner's lock too
        self.queue: OrderedDict[Path, Any] = OrderedDict()  # waiting, oldest first
        self.current: Path | None = None  # being worked on now
        self.current_item: Any = None
        self.closing = False
        self.thread: threading.Thread | None = None

    def put(self, path: Path, item: Any) -> None:
        """Under `cond`: queue `path` (its thread started on the first)."""
        self.queue[path] = item
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.cond.notify()

    def close(self) -> None:
        """Drop what waits, let the work under way end, and end the thread."""
        with self.cond:
            self.closing = True
            self.queue.clear()
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.closing)
                if self.closing:
                    return
                path, item = self.queue.popitem(last=False)
                self.current, self.current_item = path, item
            result: Any = None
            try:
                result = self.work(path, item)
            except Exception:
                log.exception("KV disk tier: %s %s failed", self.name, path)
            finally:
                with self.cond:
                    self.current = self.current_item = None
                    after = self._record(path, item, result)
                    self.cond.notify_all()
            if after is not None:
                try:
                    after()
                except Exception:
                    log.exception("KV disk tier: %s: waking the step loop failed", self.name)

    def _record(self, path: Path, item: Any, result: Any) -> Callable[[], object] | None:
        """Under `cond`: `done`, whose exception is logged too (raised out of `_run` it ended
        the thread, and every path queued after waited for good)."""
        try:
            return self.done(path, item, result)
        except Exception:
            log.exception("KV disk tier: %s: recording %s failed", self.name, path)
            return None
