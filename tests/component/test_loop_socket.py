"""LoopSocket (common/wire/loop_socket.py) on real ZeroMQ sockets over loopback TCP: what a
reader without pyzmq's futures must still do (order, every wake-up, a full peer, close)."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import select
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
import zmq
import zmq.asyncio

from pdserve.common.wire.loop_socket import BURST, LoopSocket

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,  # the loop every process of pdserve runs
}


def on_both_loops(body: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test `body` on asyncio's own loop and on uvloop, as a parametrized sync test."""

    def test(loop: str, **kwargs: Any) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(body(**kwargs))

    first = inspect.Parameter("loop", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    given = list(inspect.signature(body).parameters.values())
    test.__signature__ = inspect.Signature([first, *given])  # type: ignore[attr-defined]
    test.__name__, test.__doc__ = body.__name__, body.__doc__
    return pytest.mark.parametrize("loop", sorted(LOOPS))(test)


class Counting(LoopSocket):
    """Counts the loop's calls of the descriptor's callback, and a reader's sleeps."""

    calls = sleeps = 0

    def _on_readable(self) -> None:
        self.calls += 1
        super()._on_readable()

    async def _wait(self) -> None:
        self.sleeps += 1
        await super()._wait()


def _pair(
    kind: int, peer_kind: int, hwm: int = 1000
) -> tuple[zmq.asyncio.Context, Counting, zmq.Socket]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)  # set before the pipes exist: they take it at creation
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer: zmq.Socket[bytes] = zmq.Context.instance().socket(peer_kind)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, hwm)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)  # a test fails rather than hangs
    if peer_kind == zmq.DEALER:
        peer.setsockopt(zmq.IDENTITY, b"peer")
    peer.connect(f"tcp://127.0.0.1:{port}")
    return ctx, Counting(sock), peer


def _close(ctx: zmq.asyncio.Context, ls: LoopSocket, peer: zmq.Socket) -> None:
    ls.close()
    peer.close()
    ctx.term()


async def _asleep(ls: LoopSocket) -> None:
    """Until a reader sleeps on the descriptor (10 s at most)."""
    until = time.monotonic() + 10
    while not ls._waiters:
        assert time.monotonic() < until, "the reader never went to sleep"
        await asyncio.sleep(0)


def _announce(peer: zmq.Socket, body: bytes) -> None:
    """A message the peer sends reaches the socket's mailbox while the loop cannot look (this
    blocks it on purpose; 0.1 s also passes libzmq's throttle on a send's command
    processing)."""
    peer.send(body)
    time.sleep(0.1)


@on_both_loops
async def test_a_burst_arrives_whole_and_in_order() -> None:
    ctx, ls, peer = _pair(zmq.PULL, zmq.PUSH)
    try:
        for i in range(3000):
            peer.send(i.to_bytes(4, "big"))
        got = [int.from_bytes(await asyncio.wait_for(ls.recv(), 10), "big") for _ in range(3000)]
        assert got == list(range(3000))
    finally:
        _close(ctx, ls, peer)


@on_both_loops
async def test_a_reader_that_never_finds_its_queue_empty_lets_others_run() -> None:
    """A flood (or more token batches than the gateway keeps up with): every receive finds
    a message, so the reader never awaited anything that suspends, and the gateway's SSE
    writes, HTTP handlers and liveness checks waited for the whole burst."""
    ctx, ls, peer = _pair(zmq.PULL, zmq.PUSH, hwm=5000)
    try:
        for i in range(3000):
            peer.send(i.to_bytes(4, "big"))
        while ls.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0:  # the first one is in
            await asyncio.sleep(0.01)
        time.sleep(0.2)  # the rest too (loopback: 3,000 four-byte messages), before reading
        got: list[bytes] = []
        turns: list[int] = []  # messages read by each turn another task had

        async def reader() -> None:
            while len(got) < 3000:
                got.append(await ls.recv())  # no wait_for: it would suspend each time

        async def other() -> None:
            while len(got) < 3000:
                turns.append(len(got))
                await asyncio.sleep(0)

        await asyncio.gather(reader(), other())
        gaps = [b - a for a, b in itertools.pairwise(turns)]
        assert len(turns) >= 3000 // BURST and max(gaps) <= BURST, (len(turns), max(gaps))
    finally:
        _close(ctx, ls, peer)


@pytest.mark.parametrize("send_to", [b"peer", b"gone"])
@on_both_loops
async def test_a_send_that_takes_the_read_signal_wakes_the_reader(send_to: bytes) -> None:
    """A message announced on the descriptor, then a send on the same socket (one that
    succeeds, or one to a peer that left, which fails) processes that announcement before
    the loop sees it: the descriptor is quiet, the message queued. The send must wake the
    reader; without that each round below waits out its timeout and fails."""
    ctx, ls, peer = _pair(zmq.ROUTER, zmq.DEALER)
    try:
        peer.send(b"hello")
        assert await asyncio.wait_for(ls.recv_multipart(), 10) == [b"peer", b"hello"]
        quiet = 0
        for i in range(10):
            reader = asyncio.create_task(ls.recv_multipart())
            await _asleep(ls)
            _announce(peer, b"m%d" % i)
            announced = bool(select.select([ls._fd], [], [], 0)[0])
            try:
                await ls.send_multipart([send_to, b"r%d" % i])
            except zmq.ZMQError as exc:
                assert send_to == b"gone" and exc.errno == zmq.EHOSTUNREACH
            # the case this test is about: the signal there before the send, gone after it
            quiet += announced and not select.select([ls._fd], [], [], 0)[0]
            assert await asyncio.wait_for(reader, 5) == [b"peer", b"m%d" % i]
            if send_to == b"peer":
                assert peer.recv() == b"r%d" % i
        # a send processes commands at most once a millisecond: on a host too slow for it in
        # 0.1 s the signal stays and the reader wakes on it (then this round proves nothing)
        assert quiet >= 1, "the sends never took the signal: nothing was tested"
    finally:
        _close(ctx, ls, peer)


@on_both_loops
async def test_a_signal_or_a_send_that_announces_no_message_wakes_no_reader() -> None:
    """Any send may process the command announcing a message, so a send checks for one and
    wakes the reader if there is; and the descriptor signals for commands that are not
    messages (a peer connecting or leaving). A reader woken for nothing finds nothing and
    sleeps again: a task step (~40 us) for each reply a gateway sends. Neither wakes it here:
    50 replies, 5 peers coming and going, no message queued, no wake-up."""
    ctx, ls, peer = _pair(zmq.ROUTER, zmq.DEALER)
    others: list[zmq.Socket] = []
    try:
        peer.send(b"hello")
        assert await asyncio.wait_for(ls.recv_multipart(), 10) == [b"peer", b"hello"]
        reader = asyncio.create_task(ls.recv_multipart())
        await _asleep(ls)
        sleeps, calls = ls.sleeps, ls.calls
        for i in range(50):
            await ls.send_multipart([b"peer", b"r%d" % i])
            assert peer.recv() == b"r%d" % i
        address = ls.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        for _ in range(5):  # a pipe attached and detached: commands, no message
            other = zmq.Context.instance().socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            other.connect(address)
            others.append(other)
        until = time.monotonic() + 10
        while ls.calls == calls:  # the loop sees the descriptor's signal
            assert time.monotonic() < until, "the descriptor never signalled: nothing tested"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        # nothing was queued for it: a reader woken would have slept again, counted here
        assert ls.sleeps == sleeps, f"the reader woke {ls.sleeps - sleeps} times for nothing"
        peer.send(b"after")
        assert await asyncio.wait_for(reader, 10) == [b"peer", b"after"]
    finally:
        for other in others:
            other.close()
        _close(ctx, ls, peer)


@on_both_loops
async def test_messages_left_unread_do_not_spin_the_loop() -> None:
    """The descriptor is level-triggered: a signal nobody waits for must be cleared, not
    called back on every loop turn (a spinning loop calls it thousands of times a second)."""
    ctx, ls, peer = _pair(zmq.PULL, zmq.PUSH)
    try:
        reader = asyncio.create_task(ls.recv())
        await _asleep(ls)
        reader.cancel()  # nobody reads: the next message is announced to nobody
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert not ls._waiters
        for i in range(100):
            peer.send(b"%d" % i)
        before = ls.calls
        await asyncio.sleep(1.0)
        assert ls.calls - before <= 5, f"{ls.calls - before} callbacks in 1 s: the loop spun"
        got = [await asyncio.wait_for(ls.recv(), 10) for _ in range(100)]
        assert got == [b"%d" % i for i in range(100)]
    finally:
        _close(ctx, ls, peer)


@on_both_loops
async def test_a_send_to_a_full_peer_fails_at_once_and_strands_no_reader() -> None:
    ctx, ls, peer = _pair(zmq.ROUTER, zmq.DEALER, hwm=2)
    try:
        peer.send(b"hello")  # the ROUTER learns the peer's identity
        await asyncio.wait_for(ls.recv_multipart(), 10)
        payload = b"x" * (1 << 20)
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(256):  # until the peer's pipe is full (2 messages, then kernel buffers)
                await asyncio.wait_for(ls.send_multipart([b"peer", payload]), 1)
                sent += 1
        assert 0 < sent < 256
        # the reader still hears the full peer, and the peer gets all that was taken
        reader = asyncio.create_task(ls.recv_multipart())
        await _asleep(ls)
        peer.send(b"after")
        assert await asyncio.wait_for(reader, 10) == [b"peer", b"after"]
        assert all(peer.recv() == payload for _ in range(sent))
        until = time.monotonic() + 10
        while True:  # the room the peer made is processed on the socket's next calls
            try:
                await ls.send_multipart([b"peer", b"room again"])
                break
            except zmq.Again:
                assert time.monotonic() < until, "no room after the peer read everything"
                await asyncio.sleep(0.01)
        assert peer.recv() == b"room again"
    finally:
        _close(ctx, ls, peer)


@on_both_loops
async def test_close_ends_a_waiting_reader_and_cancel_leaves_no_waiter() -> None:
    ctx, ls, peer = _pair(zmq.PULL, zmq.PUSH)
    reader = None
    try:
        first = asyncio.create_task(ls.recv())
        await _asleep(ls)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not ls._waiters
        peer.send(b"after")
        assert await asyncio.wait_for(ls.recv(), 10) == b"after"
        reader = asyncio.create_task(ls.recv())
        await _asleep(ls)
    finally:
        _close(ctx, ls, peer)
    assert reader is not None and ls._fd == -1
    with pytest.raises(zmq.ZMQError):
        await asyncio.wait_for(reader, 5)
    with pytest.raises(zmq.ZMQError):
        await ls.recv()
