"""Blocking reads for the tcp KV stream, run in a thread per connection so that a frame
costs the kernel's copy and a few system calls, not an event-loop wakeup per socket
buffer's worth of bytes.

`recv_views` fills a list of writable views (the reserved blocks' runs) with `recvmsg_into`
and MSG_WAITALL: one system call per frame however many runs it lands in (up to IOV_MAX
views at a time), where reading through the event loop took one per socket buffer and a
scattered target one per block. Timeouts are the kernel's (SO_RCVTIMEO): a call that moves
no byte for that long fails, one that moves some returns them and the caller goes on, so a
slow but live peer never times out.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

IOV_MAX = 1024  # Linux's limit on the buffers of one recvmsg


class Stalled(TimeoutError):
    """No byte moved for the socket's timeout."""


@dataclass
class WireStats:
    """System calls and bytes, for the check that a frame lands in a bounded number of
    receives (a copy or a per-chunk read coming back shows up here first)."""

    recv_calls: int = 0
    recv_bytes: int = 0


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose reads and writes fail after `seconds` without progress."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, timeval)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views left after the first `n` bytes were moved (one pass, one slice)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    if n and i < len(views):
        return [views[i][n:], *views[i + 1 :]]
    return views[i:]


def recv_views(
    sock: socket.socket, views: Sequence[memoryview], stats: WireStats, idle_ok: bool = False
) -> None:
    """Fill `views` in order from the stream. `idle_ok`: before the first byte, a timeout
    means an idle stream (read on); after it, a stall."""
    left = [v.cast("B") for v in views if len(v)]
    started = False
    while left:
        try:
            n = sock.recvmsg_into(left[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, InterruptedError) as exc:  # SO_RCVTIMEO: nothing came
            if idle_ok and not started:
                continue
            if isinstance(exc, InterruptedError):
                continue
            raise Stalled("the KV stream stalled mid-frame") from exc
        stats.recv_calls += 1
        if n == 0:
            raise ConnectionError("the KV stream closed")
        stats.recv_bytes += n
        started = True
        left = _advance(left, n)
