"""Where a stream backend's frames land (FrameSink): the decode node's side of the
self-describing stream, over the intake's reservations.

The stream's reader threads claim a frame's target and say it landed themselves, under the
intake's lock, without waiting for the event loop: a round trip to the loop per frame (two
thread wakeups each, 0.15-1.6 ms on two busy vCPUs) held the reader while the sender filled
the socket, and cost the tcp stream a fifth of the socket's speed (benchmarks/kv_transfer.py).
The loop is asked only when the thread cannot decide: the header has not come yet (the
reader waits for it on the loop, `open_frame`), the cache cannot be written in place (GPU,
sim: a scratch buffer copied in on the loop), a stream broke mid-frame, or a landed frame
completes or ends a transfer (`frame_written` hands that back to the loop).

The lock makes a claim and the loop's releases exclusive: a claim marks the transfer
`receiving` only if it is not dropped, and `drop`/`forget` release the blocks only if it is
not receiving (else the landing releases them), so no block is reused while a frame is
written into it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.common.aio import wait_event
from pdserve.common.kv.base import Intake

if TYPE_CHECKING:
    from pdserve.common.kv.intake import KvIntake

log = logging.getLogger(__name__)

ASK_LOOP = object()  # claim_frame: the event loop's open_frame must decide


class FrameSink(Protocol):
    """Where the decode node's frames go (the KV intake)."""

    async def open_frame(
        self, peer: str, request_id: str, layer: int, nbytes: int
    ) -> Sequence[memoryview] | None:
        """Writable views (total `nbytes`) for this frame, or None to discard it."""
        ...

    async def frame_landed(self, peer: str, request_id: str, layer: int, ok: bool) -> None:
        """The frame opened last is in place (ok), or its stream broke mid-frame."""
        ...

    def claim_frame(self, peer: str, request_id: str, layer: int, nbytes: int) -> Any:
        """Reader thread, without the event loop: views as `open_frame` gives, None, or
        ASK_LOOP (then `open_frame` decides)."""
        ...

    def frame_written(
        self, peer: str, request_id: str, layer: int
    ) -> Coroutine[Any, Any, None] | None:
        """Reader thread: the frame claimed last is in place; what is left for the loop."""
        ...

    async def frame_lost(self, peer: str, request_id: str) -> None:
        """A head of this transfer's frame was read off a stream being shut, nothing claimed."""
        ...


class StreamLanding:
    def __init__(self, intake: KvIntake) -> None:
        self.intake = intake

    def _claimable(self, peer: str, intake: Intake | None, layer: int, nbytes: int) -> bool:
        """Whether this frame may be written into the transfer's blocks now (lock held). Its
        size is the header's, which the intake held to this cache's layout (`_malformed`)."""
        if intake is None or intake.dropped or intake.header.prefill_node != peer:
            return False
        h = intake.header
        if nbytes != h.frame_bytes or not 0 <= layer < h.num_layers or layer in intake.layers:
            return False
        return not intake.receiving  # else a frame of it lands on another stream (a reconnect)

    # -- reader threads ---------------------------------------------------------------------
    def claim_frame(self, peer: str, request_id: str, layer: int, nbytes: int) -> Any:
        """Reader thread: writable views of the frame's blocks (the transfer is `receiving`
        until `frame_written`), None to read and discard it, or ASK_LOOP."""
        owner = self.intake
        with owner.lock:
            intake = owner.incoming.get(request_id)
            if intake is None:
                return None if request_id in owner.closed else ASK_LOOP
            if not self._claimable(peer, intake, layer, nbytes):
                return None
            views = owner.kv.kv_targets(layer, *owner.frame_target(intake))
            if views is None:
                return ASK_LOOP  # a scratch buffer, copied in on the loop
            intake.receiving = True
            return views

    def frame_written(
        self, peer: str, request_id: str, layer: int
    ) -> Coroutine[Any, Any, None] | None:
        """Reader thread: the frame claimed last is in its blocks. What is left for the event
        loop (the transfer complete, or dropped meanwhile), or None."""
        owner = self.intake
        with owner.lock:
            intake = owner.incoming.get(request_id)
            if intake is None:  # forgotten while receiving cannot be (forget waits for it)
                return None
            intake.receiving = False
            if not intake.dropped:
                owner.mark_landed(intake, layer)
                if not intake.complete:
                    return None
        return self._after_written(request_id, intake)

    async def _after_written(self, request_id: str, intake: Intake) -> None:
        owner = self.intake
        if owner.incoming.get(request_id) is not intake:
            return  # completed by its KvDone, or forgotten, meanwhile
        if intake.dropped:  # dropped while its frame landed: the blocks are free now
            owner.free(intake)
            owner.forget(request_id)
        elif intake.complete:
            await owner.finish(intake)

    # -- the event loop -----------------------------------------------------------------------
    async def open_frame(
        self, peer: str, request_id: str, layer: int, nbytes: int
    ) -> Sequence[memoryview] | None:
        owner = self.intake
        intake = owner.incoming.get(request_id)
        if intake is None and request_id not in owner.closed:
            # the header travels on ZeroMQ and may lag the frame: wait for it a moment
            event = owner.arrivals.setdefault(request_id, asyncio.Event())
            try:
                if not await wait_event(event, owner.timeout):
                    log.warning("KV frame of %s from %s came without a header", request_id, peer)
                    if request_id not in owner.incoming:  # its other layers: discarded at
                        owner.remember_closed(request_id)  # once, not another wait each
            finally:
                if owner.arrivals.get(request_id) is event:
                    del owner.arrivals[request_id]
            intake = owner.incoming.get(request_id)
        with owner.lock:
            if intake is None or not self._claimable(peer, intake, layer, nbytes):
                return None
            views = owner.kv.kv_targets(layer, *owner.frame_target(intake))
            intake.receiving = True  # set once nothing here can raise: it holds the blocks
        if views is not None:
            return views
        if intake.state is None or len(intake.state) < nbytes:
            intake.state = bytearray(nbytes)  # a cache that cannot be written in place
        return [memoryview(intake.state)[:nbytes]]

    async def frame_lost(self, peer: str, request_id: str) -> None:
        """Its frame will never land (the listener shut the stream to make room): refused
        now, not at its stall timeout."""
        owner = self.intake
        intake = owner.incoming.get(request_id)
        if intake is not None and intake.header.prefill_node == peer and owner.drop(request_id):
            await owner.refuse(intake.peer, request_id, "KV stream failed")

    async def frame_landed(self, peer: str, request_id: str, layer: int, ok: bool) -> None:
        """The frame opened by `open_frame` (or, with ok False, by either) has landed, or
        its stream broke mid-frame."""
        owner = self.intake
        intake = owner.incoming.get(request_id)
        if intake is None:
            return
        with owner.lock:  # landed in the same hold: no claim of this layer in between
            intake.receiving = False
            dropped = intake.dropped
            if ok and not dropped and intake.state is None:
                owner.mark_landed(intake, layer)
        if dropped:  # dropped while its frame landed: the blocks are free now
            owner.free(intake)
            owner.forget(request_id)
            return
        if not ok:
            if owner.drop(request_id):
                await owner.refuse(intake.peer, request_id, "KV stream failed")
            return
        if intake.state is not None:  # a cache no thread writes in place: every claim of
            frame = memoryview(intake.state)[: intake.header.frame_bytes]  # it is on the loop
            owner.kv.import_kv(layer, *owner.frame_target(intake), frame)
            owner.mark_landed(intake, layer)
        if intake.complete:
            await owner.finish(intake)
