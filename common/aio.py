"""asyncio helpers the standard library lacks on every Python pdserve runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """`event.wait()` for at most `timeout` seconds (None: no limit); True if it was set.

    Not `asyncio.wait_for`: before Python 3.12 it swallows a cancellation that arrives in the
    turn the event is set (gh-86296), so a loop waiting on it and cancelled at shutdown goes
    on forever and whatever awaits its end hangs (the gateway's placement rounds did)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait([waiter], timeout=timeout)
    finally:
        waiter.cancel()  # no-op once done
    return bool(done)


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for(aw, timeout)` without gh-86296 (above): a cancellation arriving in
    the turn `aw` completes is raised, not dropped for its result. Past `timeout`, `aw` is
    cancelled and TimeoutError raised, as wait_for does."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait([fut], timeout=timeout)
    except asyncio.CancelledError:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        await asyncio.wait([fut])  # as wait_for: ended before the timeout is raised
        raise asyncio.TimeoutError
    return fut.result()
