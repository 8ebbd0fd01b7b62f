"""common/aio.py: waiting on an event with a deadline, cancellable in every turn."""

from __future__ import annotations

import asyncio

from pdserve.common.aio import wait_event


async def test_wait_event_is_set_or_times_out():
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5)
    assert await wait_event(event, 0)  # already set


async def test_a_cancel_in_the_turn_the_event_is_set_ends_the_waiting_loop():
    """asyncio.wait_for (Python < 3.12) returned the event's result and dropped the cancel:
    the placement rounds' loop went on, and the gateway's stop awaiting it hung."""
    event, rounds = asyncio.Event(), 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            event.clear()
            await wait_event(event, 30)

    for _ in range(20):  # each time: set, then cancel before the waiter runs again
        task = asyncio.create_task(loop())
        await asyncio.sleep(0)  # the loop waits
        event.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done and task.cancelled(), f"the cancel was swallowed after {rounds} rounds"
