"""A frame on its way to the host, as staging.py makes them. Its own module, free of torch:
the KV sender only asks whether a payload is one, and a sim node, which sends bytes, must not
pay torch's import (1.5 s a process) for that question."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Staged:
    """A frame on its way to the host: `host` holds its bytes once `wait()` returns."""

    host: torch.Tensor
    event: Any = None  # torch.cuda.Event, None on CPU
    buffer: torch.Tensor | None = None  # the pooled pinned buffer it lives in
    # how its host tensor becomes bytes: staging.host_bytes, handed in by Staging (the one
    # place that reads tensor memory, and this module stays free of torch)
    reader: Callable[[torch.Tensor], memoryview] | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    @property
    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def bytes(self) -> memoryview:
        assert self.reader is not None, "a Staged is made by Staging, which sets its reader"
        self.wait()
        return self.reader(self.host)
