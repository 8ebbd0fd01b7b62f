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

IOV_MAX = 1024  # Linux's limit on the buffers of one recvmsg or sendmsg
MAGIC = b"PDKV"
HEAD = struct.Struct("<4sIQH")  # a frame's head: magic, layer, payload bytes, request id bytes


class Stalled(TimeoutError):
    """No byte moved for the socket's timeout."""


class Closed(ConnectionError):
    """The stream ended before the first byte of a read: at a frame's boundary, a clean end."""


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


def _bytes(view: memoryview) -> memoryview:
    """`view` as bytes, for `_advance`'s byte counts; a byte view as it is (a fragmented
    frame has 500: a cast each cost a third of the reader's time between frames)."""
    plain = view.ndim == 1 and view.format == "B" and view.c_contiguous
    return view if plain else view.cast("B")


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views left after the first `n` bytes were moved (one pass, one slice)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    if n and i < len(views):
        return [views[i][n:], *views[i + 1 :]]
    return views[i:]


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Write `views` in order to a blocking socket: one `sendmsg` for them all (more only if
    interrupted, or past IOV_MAX views); SO_SNDTIMEO: no progress for that long fails it."""
    left = [_bytes(v) for v in views if v.nbytes]
    while left:
        try:
            n = sock.sendmsg(left[:IOV_MAX])
        except InterruptedError:
            continue
        except BlockingIOError as exc:  # SO_SNDTIMEO: the peer took nothing
            raise Stalled("the KV stream's peer stopped reading") from exc
        left = _advance(left, n)


def recv_views(
    sock: socket.socket, views: Sequence[memoryview], stats: WireStats, idle_ok: bool = False
) -> None:
    """Fill `views` in order from the stream. `idle_ok`: before the first byte, a timeout
    means an idle stream (read on); after it, a stall."""
    left = [_bytes(v) for v in views if v.nbytes]
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
            raise (
                Closed("the KV stream closed")
                if not started
                else ConnectionError("the KV stream closed mid-read")
            )
        stats.recv_bytes += n
        started = True
        left = _advance(left, n)


def closed_by_peer(sock: socket.socket) -> bool:
    """The decode node sends nothing after its challenge: a readable end of stream (or an
    error) on a stream between frames means it closed it."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected
