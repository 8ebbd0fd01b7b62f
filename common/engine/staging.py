"""Where KV bytes cross between a device cache and host memory: the one staging path.

Every frame, block or segment that leaves or enters the paged cache as bytes goes through
here, on every device:

- CUDA: device -> host copies go into reused pinned buffers, issued non-blocking on a side
  stream that first waits for the compute stream (so layer i's copy starts as soon as layer
  i's KV is written and runs while later layers compute), and an event per copy says when
  the bytes are there; host -> device copies go from a pinned buffer on the compute stream,
  so whatever reads the cache next runs behind them.
- CPU: the same calls; the "copy" is a view (device -> host) or a plain host copy, and the
  events are already complete. The CPU tests therefore run this code.

Nothing else may turn a tensor into bytes: `host_bytes` is the only place that touches a
tensor's memory through numpy, and it refuses a device tensor (a CUDA tensor has no host
memory to view; tests/unit/test_staging.py scans the package for any other such access).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pdserve.common.engine.staged import Staged as Staged  # where it lives (torch-free)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if t.device.type != "cpu":
        raise ValueError(f"host_bytes of a {t.device} tensor: stage it to the host first")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy().data)


class Staging:
    """Host buffers and the copy stream of one cache's device."""

    def __init__(self, device: torch.device, max_free: int = 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: list[torch.Tensor] = []  # pinned uint8 buffers, reused (fresh pinned
        self.max_free = max_free  # memory costs far more than a copy)
        # the engine thread, worker threads and the event loop all stage and give back
        self.lock = threading.Lock()

    # -- device -> host -------------------------------------------------------------------
    def to_host(self, t: torch.Tensor) -> Staged:
        """Start copying `t` to host memory; on CPU `t` itself (no copy)."""
        if not self.cuda:
            return Staged(t.contiguous(), reader=host_bytes)
        assert self.stream is not None
        nbytes = t.numel() * t.element_size()
        buf = self._take(nbytes)
        host = buf[:nbytes].view(t.dtype).view(t.shape)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the allocator must not reuse t's memory early
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(host, event, buf, reader=host_bytes)

    def give_back(self, staged: Staged) -> None:
        """The host bytes are no longer needed (sent, or copied elsewhere)."""
        if staged.buffer is not None:
            staged.wait()
            self._put(staged.buffer)
            staged.buffer = None

    # -- host -> device -------------------------------------------------------------------
    def to_device(self, data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Host bytes (any buffer) as a tensor on this device. On CUDA the copy goes through a
        pinned buffer on the copy stream, and the compute stream waits for it."""
        src = torch.frombuffer(data, dtype=torch.uint8)
        if not self.cuda:
            return src.view(dtype).view(shape)
        buf = self._take(src.numel())
        buf[: src.numel()].copy_(src)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        # on the compute stream: `out` comes from its pool, so ordering is free, and what
        # reads the cache next runs behind the copy
        stream = torch.cuda.current_stream(self.device)
        out.view(-1).view(torch.uint8).copy_(buf[: src.numel()], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        event.synchronize()  # the pinned buffer is free again only after the copy
        self._put(buf)
        return out

    def _take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
            if fits:  # by index: `list.remove` would compare tensors with ==
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())  # powers of two: reuse across sizes
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)

    def _put(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
            if len(self.free) > self.max_free:  # bounded: the smallest goes
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
