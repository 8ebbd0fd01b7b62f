"""Decode side of KV transfer: reservations, frames into the paged cache, acknowledgements.

A `KvHeader` asks `reserve` for blocks (a block table, or the reason to refuse, answered
with `KvRefuse`) and its backend's `ReceiveConnector` prepares (`open`). Each layer's frame is
put into those blocks: behind a `KvLayer` descriptor the connector says where the frame is
(ZeroMQ parts, a shared-memory segment, a UCX receive); a stream backend (tcp) lands frames
itself through this intake's `landing` (landing.FrameSink): its frames carry their own
head, need no descriptor and may arrive before the header (the stream reader waits for it a
moment). A transfer is complete once it has every layer and its `KvDone`, in either
order (frames and ZeroMQ messages may travel on different connections); then it goes to
`admit` and the peer gets `KvAck`.

Leases: until its first frame, a reservation lives as long as the gateway knows the request
(the node's heartbeat lists it, the reply names stale ids); the prefill forward pass may take
any time. From its first frame (or KvDone) on, a transfer that makes no progress for
`timeout` seconds is released and refused. Blocks dropped while a frame lands in them are
released only after it has landed, so no other sequence's KV is ever overwritten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.interface import KvStore
from pdserve.common.kv.base import LANDED, Intake, ReceiveConnector
from pdserve.common.kv.landing import StreamLanding
from pdserve.common.prefix import token_ids_problem
from pdserve.common.wire.kv_messages import (
    TO_DECODE_DECODER,
    KvAck,
    KvDone,
    KvFetch,
    KvHeader,
    KvLayer,
    KvRefuse,
)
from pdserve.common.wire.protocol import (
    Abort,
    encode,
)
from pdserve.common.wire.transport import decode_or_none

log = logging.getLogger(__name__)
STREAMED = ("tcp",)  # backends whose frames travel apart from KvDone, maybe behind it
CLOSED_MEMORY = 4096  # recently ended transfers whose late stream frames are discarded at once

__all__ = ["Intake", "KvIntake"]


class KvIntake:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        kv: KvStore,
        reserve: Callable[[KvHeader], list[int] | str],
        release: Callable[[list[int]], None],
        admit: Callable[[Intake, int], Awaitable[None]],
        receivers: dict[str, ReceiveConnector],
        timeout: float = 10.0,
        on_fetch: Callable[[bytes, KvFetch], Awaitable[None]] | None = None,
        vocab_size: int = 1 << 32,
        on_refused: Callable[[KvHeader, str, str], None] | None = None,
    ) -> None:
        self.sock = sock
        self.kv = kv
        self.reserve = reserve
        self.release = release
        self.admit = admit
        self.receivers = receivers  # the backends this node offers, by name
        self.timeout = timeout
        self.vocab_size = vocab_size  # a first token past it would fail the decode step
        self.on_fetch = on_fetch  # a peer asks for prefix blocks of ours (common/node/fetch.py)
        # a transfer refused here (header, sender, why): a fetch of ours that waits for it
        # falls back to computing at once, not at its deadline
        self.on_refused = on_refused
        self.incoming: dict[str, Intake] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.arrivals: dict[str, asyncio.Event] = {}  # stream frames waiting for their header
        self.quarantine: list[Intake] = []  # dropped, blocks held until the writer's grant ends
        self.serving: set[asyncio.Task] = set()  # fetches of our prefixes being served
        # stream readers claim frames from their threads (landing.py): a claim and a release
        # of the same transfer's blocks exclude each other under this lock
        self.lock = threading.Lock()
        self.landing = StreamLanding(self)  # the tcp stream's FrameSink

    async def run(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                await self.handle(parts)
            except Exception:
                log.exception("KV intake failed")

    async def handle(self, parts: list[zmq.Frame]) -> None:
        if len(parts) < 2:
            return
        peer = parts[0].bytes
        msg = decode_or_none(TO_DECODE_DECODER, parts[1].bytes)
        match msg:
            case KvHeader():
                await self._on_header(peer, msg)
            case KvLayer(request_id=rid, layer=layer):
                await self._on_layer(peer, rid, layer, [p.buffer for p in parts[2:]])
            case KvDone(request_id=rid, first_token_id=token):
                intake = self.incoming.get(rid)
                if intake is None or intake.peer != peer:
                    return
                if intake.dropped:
                    self.forget(rid)
                    return
                if not intake.header.fetch and not 0 <= token < self.vocab_size:
                    self.drop(rid)
                    await self._refuse(
                        intake.peer, intake.header, f"first token {token} is not in the vocabulary"
                    )
                    return
                intake.first_token = token
                intake.progress = time.monotonic()  # from now on a stall is a failure
                if intake.complete:
                    await self.finish(intake)
                elif intake.header.backend not in STREAMED:  # its frames may still be coming
                    got = f"{len(intake.layers)}/{intake.header.num_layers}"
                    self.drop(rid)
                    await self._refuse(intake.peer, intake.header, f"got {got} layers")
            case Abort(request_id=rid):
                intake = self.incoming.get(rid)
                if intake is not None and intake.peer == peer:
                    self.drop(rid)
                    self.forget(rid)  # nothing more comes for it
            case KvFetch() if self.on_fetch is not None:
                # served beside the intake: staging a large prefix takes a while, and every
                # other transfer's frames, acks and aborts were read only after it
                task = asyncio.ensure_future(self.on_fetch(peer, msg))
                self.serving.add(task)
                task.add_done_callback(self._served)
            case _:
                log.warning("dropping malformed data message")

    async def _on_header(self, peer: bytes, h: KvHeader) -> None:
        try:
            await self._header(peer, h)
        finally:  # accepted or refused: a frame that came first waits no longer
            event = self.arrivals.pop(h.request_id, None)
            if event is not None:
                event.set()

    async def _header(self, peer: bytes, h: KvHeader) -> None:
        rid = h.request_id
        receiver = self.receivers.get(h.backend)
        if rid in self.incoming:  # never replace a live transfer's state
            return await self._refuse(peer, h, "duplicate request id")
        if receiver is None:
            self.remember_closed(rid)
            return await self._refuse(peer, h, f"KV backend {h.backend!r} not offered here")
        problem = self._malformed(peer, h)
        reserved = problem if problem is not None else self.reserve(h)  # nothing reserved then
        if isinstance(reserved, str):
            if receiver.drains_after_drop:  # its frames still come: received, discarded
                self.incoming[rid] = Intake(h, peer, [], dropped=True)
            else:
                self.remember_closed(rid)
            return await self._refuse(peer, h, reserved)
        intake = Intake(h, peer, reserved)
        self.incoming[rid] = intake
        self.closed.pop(rid, None)
        problem = receiver.open(intake)
        if problem is not None:
            self.drop(rid)
            return await self._refuse(peer, h, problem)
        grant = receiver.grant(intake, self.frame_target(intake)[0])
        if grant is not None:  # the sender writes into our blocks itself (shm_direct)
            await self._send(peer, grant)

    def _malformed(self, peer: bytes, h: KvHeader) -> str | None:
        """What no reservation may take: a header from another node than its sender, one
        whose layers or skipped prefix this cache cannot hold (fewer layers would complete a
        request with the others' blocks holding whatever they held before), or whose prompt
        this model cannot read."""
        if peer != h.prefill_node.encode():
            return "header names another node as its sender"
        if h.num_layers != self.kv.num_layers:
            return f"KV layout mismatch: {h.num_layers} layers, this cache has {self.kv.num_layers}"
        if not 0 <= h.skip_tokens < len(h.prompt_ids):
            return "KV layout mismatch: skip_tokens outside the prompt"
        if (bad := token_ids_problem(h.prompt_ids, self.vocab_size)) is not None:
            return bad  # before any hash of them
        ours = self.kv.frame_bytes(len(h.prompt_ids) - h.skip_tokens)
        if h.frame_bytes != ours:  # another dtype or head layout: no frame could land
            return f"KV layout mismatch: frames of {h.frame_bytes} bytes, this cache's {ours}"
        return None

    async def _on_layer(self, peer: bytes, rid: str, layer: int, parts: list[Any]) -> None:
        intake = self.incoming.get(rid)
        if intake is None or intake.peer != peer:
            return
        h = intake.header
        try:  # the connector must take its frame off its channel even if it will be dropped
            frame = await self.receivers[h.backend].frame(intake, layer, parts)
        except Exception as exc:  # a closed endpoint, a timeout, a UCX error: this frame only
            bug = not isinstance(exc, (OSError, asyncio.TimeoutError))
            (log.exception if bug else log.warning)("KV frame of %s from %s failed: %r", rid,
                                                    h.prefill_node, exc)  # fmt: skip
            if self.drop(rid):
                await self._refuse(intake.peer, intake.header, "KV stream failed")
            return
        if frame is LANDED:  # the sender copied it into the blocks itself
            if not intake.dropped and 0 <= layer < h.num_layers:
                self.mark_landed(intake, layer)
            return
        if isinstance(frame, list):
            got = sum(memoryview(p).nbytes for p in frame)
        else:
            got = -1 if frame is None else memoryview(frame).nbytes
        if intake.dropped:  # its frame received all the same (ucx): a drained one
            intake.progress = time.monotonic()
        if intake.dropped or got != h.frame_bytes or not 0 <= layer < h.num_layers:
            return
        self.kv.import_kv(layer, *self.frame_target(intake), frame)
        self.mark_landed(intake, layer)

    def frame_target(self, intake: Intake) -> tuple[list[int], int]:
        """Where the frames go: the blocks after those the node already held (a prefix its
        cache kept, `skip_tokens`), and how many tokens they carry."""
        h = intake.header
        skip_blocks = h.skip_tokens // self.kv.block_size
        return intake.block_table[skip_blocks:], len(h.prompt_ids) - h.skip_tokens

    def mark_landed(self, intake: Intake, layer: int) -> None:
        intake.layers.add(layer)
        intake.bytes_in += intake.header.frame_bytes
        intake.progress = time.monotonic()

    # -- endings ------------------------------------------------------------------------------
    async def finish(self, intake: Intake) -> None:
        rid = intake.header.request_id
        # a direct writer's grant closes now; if the lock is still held (not by the writer,
        # which let go before its last descriptor), confirm later: the blocks stay the
        # sequence's, only the ticket waits
        self.free(dataclasses.replace(intake, block_table=[]))
        self.forget(rid, keep_blocks=True)  # they are the sequence's now
        assert intake.first_token is not None
        await self.admit(intake, intake.first_token)
        await self._send(intake.peer, KvAck(request_id=rid))

    async def refuse(self, peer: bytes, rid: str, reason: str) -> None:
        await self._send(peer, KvRefuse(request_id=rid, reason=reason))

    async def _refuse(self, peer: bytes, h: KvHeader, reason: str) -> None:
        """Refuse a transfer whose header came, and say so here (`on_refused`)."""
        await self.refuse(peer, h.request_id, reason)
        if self.on_refused is not None:
            try:  # called from the expiry loop too, whose end would stop the node
                self.on_refused(h, peer.decode(errors="replace"), reason)
            except Exception:
                log.exception("handling the refusal of %s failed", h.request_id)

    async def _send(self, peer: bytes, msg: Any) -> None:
        """To the sending node, if it is still connected: one that went away (crashed, scaled
        down) is unroutable, and that must not end the loop that answers it (the expiry
        loop's death stopped the node)."""
        try:
            await self.sock.send_multipart([peer, encode(msg)])
        except zmq.ZMQError as exc:
            log.info("%s for %r not sent: %s", type(msg).__name__, peer, exc)

    def drop(self, rid: str) -> bool:
        """Release a reservation (abort, lease, stall). A UCX transfer stays listed, dropped,
        so that its remaining frames are still received (a large one's send waits for it)."""
        intake = self.incoming.get(rid)
        if intake is None or intake.dropped:
            return False
        with self.lock:  # a stream reader's claim sees it dropped, or this sees it receiving
            intake.dropped = True
            busy = intake.receiving
        intake.progress = time.monotonic()  # a drained placeholder lives from here (expire)
        if not busy:  # else released when its frame has landed
            self.free(intake)
            receiver = self.receivers.get(intake.header.backend)
            if receiver is None or not receiver.drains_after_drop:
                self.forget(rid)
        return True

    def free(self, intake: Intake) -> None:
        """Give the blocks back, once no writer can touch them (`revoke`); until then the
        intake waits in quarantine and `expire` tries again."""
        receiver = self.receivers.get(intake.header.backend)
        if receiver is not None and not receiver.revoke(intake):
            if all(held is not intake for held in self.quarantine):  # by identity
                self.quarantine.append(intake)  # a writer is inside its blocks: not yet
            return
        if intake.block_table:
            self.release(intake.block_table)
            intake.block_table = []

    def forget(self, rid: str, keep_blocks: bool = False) -> None:
        """The transfer is over here. Its blocks go back with it (unless admitted), except
        while a frame is landing in them: then its landing releases and forgets it."""
        intake = self.incoming.get(rid)
        if intake is not None:
            with self.lock:  # gone before a stream reader could claim it
                if intake.receiving:
                    intake.dropped = True
                    return
                del self.incoming[rid]
            if not keep_blocks:
                self.free(intake)
            if intake.header.backend in self.receivers:
                self.receivers[intake.header.backend].close_intake(intake)
        self.remember_closed(rid)

    def remember_closed(self, rid: str) -> None:
        self.closed[rid] = None
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    @property
    def active(self) -> list[str]:
        return [rid for rid, i in self.incoming.items() if not i.dropped]

    async def expire(self, now: float) -> None:
        held, self.quarantine = self.quarantine, []
        for intake in held:
            self.free(intake)  # back in quarantine if the writer is still inside
        for rid, intake in list(self.incoming.items()):
            if intake.dropped:  # drained while its sender sends, however long its pass
                if now - max(intake.started, intake.progress) > 3 * self.timeout:
                    self.forget(rid)  # a draining transfer whose peer is gone too
                continue
            if intake.progress and now - intake.progress > self.timeout and not intake.receiving:
                log.warning(
                    "KV of %s stalled for %.1f s after %d/%d layers: freeing its reservation",
                    rid,
                    now - intake.progress,
                    len(intake.layers),
                    intake.header.num_layers,
                )
                self.drop(rid)
                await self._refuse(intake.peer, intake.header, "KV transfer timed out")

    def _served(self, task: asyncio.Task) -> None:
        self.serving.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("serving a fetch failed", exc_info=task.exception())

    async def close(self) -> None:
        for task in list(self.serving):
            task.cancel()
        for receiver in self.receivers.values():
            await receiver.close()
