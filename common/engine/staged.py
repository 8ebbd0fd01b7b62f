"""A frame on its way to the host, as staging.py makes them. Its own module, free of torch:
the KV sender only asks whether a payload is one, and a sim node, which sends bytes, must not
pay torch's import (1.5 s a process) for that question."""

from __future__ import annotations

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

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    @property
    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def bytes(self) -> memoryview:
        from pdserve.common.engine.staging import host_bytes  # torch is loaded by now

        self.wait()
        return host_bytes(self.host)
