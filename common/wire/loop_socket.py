"""A ZeroMQ socket read and written from the event loop with one wake-up per burst.

pyzmq's asyncio socket makes a future, a timer check and two or three `ZMQ_EVENTS` reads for
every message: 60-140 us of CPU a message in a gateway (its control and token sockets carry
heartbeats and token batches of every node; docs/results §13). Here a reader tries a
non-blocking receive first and waits only when nothing is queued, so messages already
queued cost one `recv` each.

ZeroMQ's file descriptor says only that the socket has commands to process, and any call on
the socket (a send too, and one that fails) may process the command that announced a
message. So: a reader tries before it sleeps; after a send, and at every signal, `ZMQ_EVENTS`
is read (it processes the pending commands, which clears the signal: a level-triggered reader
would spin on it otherwise) and the readers asleep are woken only if a message is queued (a
signal that announced no message, a send's completion say, wakes nobody: ~40 us of a task
step saved each); an empty try processed everything and found nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

T = TypeVar("T")
# messages taken in a row without a pause: a queue that never empties (a flood, or more token
# batches than the gateway keeps up with) must not hold the event loop, where SSE writes,
# HTTP requests and the liveness checks wait for a turn
BURST = 64


class LoopSocket:
    """Wraps one socket of a `zmq.asyncio` context; never mix it with the socket's own async
    methods (pyzmq would register its own reader and take the wake-ups)."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        # the same socket through the blocking API: calls without futures
        self._plain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._fd = -1  # a duplicate of the socket's descriptor, watched once a loop asks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._taken = 0  # taken since this socket's reader last let others run

    async def recv_multipart(self) -> list[bytes]:
        return await self._take(zmq.Socket.recv_multipart)

    async def recv(self) -> bytes:
        return await self._take(zmq.Socket.recv)

    async def _take(self, receive: Callable[[zmq.Socket, int], T]) -> T:
        self._taken += 1
        if self._taken >= BURST:
            self._taken = 0
            await asyncio.sleep(0)
        while True:
            try:
                got = receive(self._live(), zmq.NOBLOCK)
            except zmq.Again:
                # the count runs on: a wait that finds the descriptor ready need not suspend,
                # so others may not have run (a burst of 5 + 64 between their turns)
                await self._wait()
                continue
            self._wake()  # it may have processed another reader's announcement
            return got

    async def send_multipart(self, parts: list[Any], copy: bool = False) -> None:
        """One non-blocking send, for ROUTER sockets (ROUTER_MANDATORY): `zmq.Again` when
        that peer is at its high-water mark, `ZMQError(EHOSTUNREACH)` when it is gone.
        pyzmq's socket waits until any peer has room, then tries once more and raises
        `zmq.Again` if this one has none: on a ROUTER with other peers, at once too. Never
        waiting is what a gateway wants: a node that lets a thousand messages pile up is
        wedged, and liveness deals with it, not a handler stuck on its reply. Not for
        PUSH/DEALER (their load balancing can fail a message after its first frame)."""
        try:
            self._live().send_multipart(parts, zmq.NOBLOCK, copy=copy)
        finally:
            if self._waiters:  # it may have processed the command announcing a message
                self._wake_if_queued()

    def close(self) -> None:
        self._unwatch()
        self.sock.close()
        self._wake()  # whoever waits finds the socket closed

    # -- waiting --------------------------------------------------------------------------
    def _live(self) -> zmq.Socket:
        """The shadow, while the socket lives (after its close the shadow's pointer dangles)."""
        if self.sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        return self._plain

    async def _wait(self) -> None:
        if self._fd < 0:
            loop = asyncio.get_running_loop()
            # its own descriptor: a second reader on the socket's number would replace any other
            fd = os.dup(int(self._live().getsockopt(zmq.FD)))
            try:
                loop.add_reader(fd, self._on_readable)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._loop = fd, loop
            return  # watched from now on: try once more before sleeping
        waiter = self._loop.create_future() if self._loop else asyncio.Future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _on_readable(self) -> None:
        if self.sock.closed:  # closed behind this wrapper's back: stop watching
            self._unwatch()
            self._wake()  # whoever waits finds it closed
        else:  # cleared either way; nobody waiting: the next try finds what it announced
            self._wake_if_queued()

    def _wake_if_queued(self) -> None:
        """Reads `ZMQ_EVENTS` (processing the socket's commands clears its signal) and wakes
        the readers asleep if a message is queued, or the socket cannot say (closed, its
        context ended: they find out)."""
        try:
            queued = self.sock.closed or bool(int(self._plain.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:  # its context ended: nothing clears the descriptor any more
            self._unwatch()
            queued = True
        if queued:
            self._wake()

    def _unwatch(self) -> None:
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _wake(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
