"""Prefill side of KV transfer: one ordered channel per decode peer, frames by connector.

`begin` picks the backend for the target (`choose`), lets it prepare (`SendConnector.begin`)
and sends the header, so the decode node reserves blocks while we compute. `stage` runs in
the engine thread as each layer lands in the cache (the connector hands out views of the
cache, a staged frame, or writes into shared memory). `push` (event loop) queues the layer's
descriptor and frame on the peer's outbox; one sender task per peer keeps the order header,
layers, done, whatever the backend. The sender owns a transfer until the decode node
acknowledges it; `on_ack`/`on_refuse` report back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.staged import Staged
from pdserve.common.kv import backend, choose
from pdserve.common.kv.base import Local, SendConnector, Transfer
from pdserve.common.logs import Every
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import (
    TO_PREFILL_DECODER,
    KvAck,
    KvDone,
    KvGrant,
    KvHeader,
    KvLayer,
    KvRefuse,
)
from pdserve.common.wire.protocol import Abort, DecodeTarget, Msg, encode
from pdserve.common.wire.transport import decode_or_none, make_socket

log = logging.getLogger(__name__)
ACK_MAX_MSG = 1 << 20
PEER_IDLE_S = 300.0  # a peer sent nothing this long (a decode node scaled away): let go

__all__ = ["KvSender", "Transfer"]


class TransferEnded(RuntimeError):
    """A stage of a transfer already released (aborted, refused, served)."""


@dataclass
class _Item:
    parts: list[Any]  # ZeroMQ parts (may be empty)
    transfer: Transfer | None = None  # with a layer's frame: the connector sends it after
    layer: int = 0
    payload: Any = None
    framed: bool = False  # a layer: its parts are made when its turn comes (_frame_parts)
    commit: bool = False  # KvDone: sent once the transfer's frames are out (_settled)


@dataclass
class Peer:
    node_id: str
    sock: zmq.asyncio.Socket
    address: str  # its data socket: a restarted node has a new one
    outbox: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    failed: int = 0  # frames that failed since the last warning (logged at most every 5 s)
    warned_at: float = -1e9
    used_at: float = 0.0  # when something was last queued for it


class KvSender:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        local: Local,
        on_ack: Callable[[Transfer], None],
        on_refuse: Callable[[str, str, str], Any],
        on_stray_refuse: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.ctx, self.local = ctx, local
        self.on_ack, self.on_refuse = on_ack, on_refuse
        # a KvRefuse naming no transfer of ours: the answer to a KvFetch we sent (node/fetch.py)
        self.on_stray_refuse = on_stray_refuse
        self.num_layers = local.kv.num_layers
        self.connectors: dict[str, SendConnector] = {}
        self.peers: dict[str, Peer] = {}
        self.swept_at = time.monotonic()  # idle peers last let go
        self.fallbacks = Every(5.0)  # a full /dev/shm fails every transfer: a line in 5 s
        self.lock = threading.Lock()  # a transfer's stages in flight against its release
        self.transfers: dict[str, Transfer] = {}

    def connector(self, name: str) -> SendConnector:
        if name not in self.connectors:
            self.connectors[name] = backend(name).send(self.local)
        return self.connectors[name]

    # -- transfer lifecycle ----------------------------------------------------------------
    def begin(
        self,
        request_id: str,
        target: DecodeTarget,
        prompt_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_table: list[int],
        skip: int = 0,
        fetch: bool = False,
        gateway: str = "",
        prompt_len: int = 0,
        stream_format: bytes = b"",
    ) -> Transfer:
        """Start a transfer; with `skip` (whole blocks) the decode node holds the first
        `skip` tokens' KV already and only the rest travels."""
        name = choose(
            self.local.forced, lambda b, ep: self.connector(b).usable(ep), target.kv_endpoints
        )
        n = len(prompt_ids) - skip
        kv = self.local.kv
        assert skip % kv.block_size == 0 and n > 0, (skip, n)
        t = Transfer(
            request_id,
            target,
            name,
            block_table[skip // kv.block_size :],  # the frames cover the rest only
            n,
            kv.frame_bytes(n),
            self.num_layers,
        )
        try:
            self.connector(name).begin(t)
        except OSError as exc:  # shm: /dev/shm is full; every decode node offers zmq
            if self.fallbacks.due():
                log.warning("KV backend %s failed (%s): sending by zmq", name, exc)
            t.backend = "zmq"
            self.connector("zmq").begin(t)
        self.transfers[request_id] = t
        header = KvHeader(
            request_id=request_id,
            prompt_ids=prompt_ids,
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            num_layers=self.num_layers,
            frame_bytes=t.frame_bytes,
            prefill_node=self.local.node_id,
            backend=t.backend,
            location=t.location,
            skip_tokens=skip,
            fetch=fetch,
            gateway=gateway,
            prompt_len=prompt_len,
            stream_format=stream_format,
        )
        self._post(target, _Item([encode(header)]))
        return t

    def stage(self, t: Transfer, layer: int) -> Any:
        """Engine thread: what the layer's descriptor and frame need (connector-specific).
        A transfer released while a stage runs in a worker thread (a fetch served, a resend)
        keeps its backend state until that stage is over: an shm segment given back at once
        was lent to the next transfer while the stale stage still wrote a layer into it."""
        with self.lock:
            if t.ended is not None:
                raise TransferEnded(t.request_id)
            t.staging += 1
        try:
            return self.connector(t.backend).stage(t, layer)
        finally:
            with self.lock:
                t.staging -= 1
                loop: Any = t.ended if t.staging == 0 else None
            if loop:  # released meanwhile: ended now, on the event loop
                loop.call_soon_threadsafe(self._end, t)

    def stage_all(self, t: Transfer) -> list[Any]:
        """Engine thread: every layer at once (short prompts, resends)."""
        return [self.stage(t, layer) for layer in range(self.num_layers)]

    def push(self, t: Transfer, layer: int, payload: Any) -> None:
        """Event loop: queue the layer (descriptor + frame) behind everything sent before.
        Its descriptor is made when its turn comes: a frame still being staged to the host
        (a CUDA copy, common/engine/staging.py) is waited for there, not here."""
        if t.ended is not None:  # released meanwhile: its state may be another's now
            return
        if not t.first_byte:
            t.first_byte = time.monotonic()
        self._post(t.target, _Item([], t, layer, payload, framed=True))

    async def _frame_parts(self, item: _Item) -> list[Any]:
        """The layer's payload with staged frames landed as bytes, and its ZeroMQ parts."""
        t = item.transfer
        assert t is not None
        item.payload = await self._landed(t, item.payload)
        extra = self.connector(t.backend).descriptor(t, item.layer, item.payload)
        head = [] if extra is None else [encode(KvLayer(request_id=t.request_id, layer=item.layer))]
        return [*head, *(extra or [])]

    async def _landed(self, t: Transfer, payload: Any) -> Any:
        if isinstance(payload, list):
            return [await self._landed(t, p) for p in payload]
        if not isinstance(payload, Staged):
            return payload
        if not payload.done:  # off the loop: a CUDA event wait blocks
            await asyncio.to_thread(payload.wait)
        t.staged.append(payload)  # its pinned buffer goes back when the transfer ends
        return payload.bytes()

    def push_all(self, t: Transfer, payloads: list[Any]) -> None:
        for layer, payload in enumerate(payloads):
            self.push(t, layer, payload)

    def send_message(self, target: DecodeTarget, msg: Msg) -> None:
        """A message to `target`'s data socket, in order with everything sent there."""
        self._post(target, _Item([encode(msg)]))

    def done(self, t: Transfer, first_token: int) -> None:
        if t.ended is not None:
            return
        done = KvDone(request_id=t.request_id, first_token_id=first_token)
        self._post(t.target, _Item([encode(done)], t, commit=True))

    def abort(self, request_id: str) -> None:
        """Tell the decode node to drop the reservation, and forget the transfer."""
        t = self.transfers.get(request_id)
        if t is not None:
            self._post(t.target, _Item([encode(Abort(request_id=request_id))]))
            self.release(request_id)

    def release(self, request_id: str) -> Transfer | None:
        t = self.transfers.pop(request_id, None)
        if t is not None:
            with self.lock:
                busy = t.staging > 0  # then the last stage in flight ends it, on this loop
                t.ended = asyncio.get_running_loop() if busy else False
            if not busy:
                self._end(t)
        return t

    def _end(self, t: Transfer) -> None:
        self.connector(t.backend).end(t)
        staging = self.local.kv.staging
        while t.staged and staging is not None:
            staging.give_back(t.staged.pop())

    # -- peers -----------------------------------------------------------------------------
    def _post(self, target: DecodeTarget, item: _Item) -> None:
        now = time.monotonic()
        if now - self.swept_at > PEER_IDLE_S / 4:
            self._let_idle_go(now, keep=target.node_id)  # not closed to be reopened at once
        peer = self.peers.get(target.node_id)
        if peer is not None and peer.address != target.data_address:
            # the node restarted under the same id, on new ports: what is queued for the old
            # process can never arrive (the gateway re-placed it), and the new one needs a
            # fresh channel, else every later transfer to it vanishes into the old address
            self._retire(peer, "has a new data address (restarted): reconnecting")
            peer = None
        if peer is None:
            sock = make_socket(
                self.ctx,
                "node.data_out",
                target.data_address,
                identity=self.local.node_id,
                max_msg=ACK_MAX_MSG,
            )
            peer = Peer(target.node_id, sock, target.data_address)
            peer.tasks = [
                asyncio.create_task(self._sender(peer)),
                asyncio.create_task(self._receiver(peer)),
            ]
            self.peers[target.node_id] = peer
        peer.used_at = now
        peer.outbox.put_nowait(item)

    def _let_idle_go(self, now: float, keep: str) -> None:
        """Every node id ever sent to kept a socket, two tasks and ZeroMQ's reconnecting to
        it for good (pods come and go): a peer with nothing queued or in transfer for
        PEER_IDLE_S is let go, and comes back on its next message."""
        self.swept_at = now
        busy = {t.target.node_id for t in self.transfers.values()}
        for peer in list(self.peers.values()):
            idle = now - peer.used_at > PEER_IDLE_S and peer.outbox.empty()
            if idle and peer.node_id not in busy and peer.node_id != keep:
                self._retire(peer, "unused: let go")

    async def _sender(self, peer: Peer) -> None:
        while True:
            item = await peer.outbox.get()
            try:
                t = item.transfer
                if item.commit:  # KvDone
                    if t is not None and await self._settled(t):
                        await peer.sock.send_multipart(item.parts)
                    continue
                if item.framed:
                    item.parts = await self._frame_parts(item)
                first = t is not None and self.connector(t.backend).writes_first
                if t is not None and first:  # the frame is in place before its descriptor
                    await self.connector(t.backend).send(t, item.layer, item.payload)
                if item.parts:  # a frame's parts go zero-copy: tracked till read out
                    tracked = t is not None and len(item.parts) > 1
                    sent = await peer.sock.send_multipart(item.parts, copy=not tracked,
                                                          track=tracked)  # fmt: skip
                    if tracked and t is not None:
                        t.trackers.append(sent)
                if t is not None and not first:
                    await self.connector(t.backend).send(t, item.layer, item.payload)
            except OSError as exc:  # the decode side sees the broken channel and refuses
                peer.failed += 1
                now = time.monotonic()
                if now - peer.warned_at >= 5.0:  # a dead peer fails every queued frame
                    log.warning(
                        "KV frame to %s failed: %s (%d failures since the last warning)",
                        peer.node_id,
                        exc,
                        peer.failed,
                    )
                    peer.warned_at, peer.failed = now, 0
            except Exception:  # one failed send must not stop this peer's channel
                log.exception("KV send to %s failed", peer.node_id)

    async def _settled(self, t: Transfer) -> bool:
        """Every frame of `t` read out of its views (written to its stream, or taken by
        ZeroMQ), and `t` not ended meanwhile: its KvDone may go. An aborted transfer's blocks
        may be another's by now: a frame still reading them would be torn KV, which the
        decode node admits and caches under the prompt's hashes once its KvDone comes."""
        await self.connector(t.backend).settle(t)
        pending, t.trackers = [tr for tr in t.trackers if not tr.done], []
        if pending and not await asyncio.to_thread(_wait_all, pending, self.local.timeout):
            log.warning("KV frames of %s not out in %.0f s: no KvDone", t.request_id,
                        self.local.timeout)  # fmt: skip
            if self.transfers.get(t.request_id) is t:  # live: as if the decode node refused
                await self._refused(t, "KV frames not out in time")
            return False
        return t.ended is None

    async def _receiver(self, peer: Peer) -> None:
        while True:
            msg = decode_or_none(TO_PREFILL_DECODER, await peer.sock.recv())
            try:
                await self._on_reply(peer, msg)
            except Exception:
                log.exception("handling a reply from %s failed", peer.node_id)

    async def _on_reply(self, peer: Peer, msg: Any) -> None:
        match msg:
            case KvAck(request_id=rid):
                t = self.transfers.get(rid)
                if t is not None and t.target.node_id == peer.node_id:
                    t.answered = True
                    self.release(rid)
                    t.finished = time.monotonic()
                    self.on_ack(t)
            case KvGrant(request_id=rid):
                t = self.transfers.get(rid)
                if t is not None and t.target.node_id == peer.node_id:
                    self.connector(t.backend).on_grant(t, msg)
            case KvRefuse(request_id=rid, reason=why):
                t = self.transfers.get(rid)
                if t is not None and t.target.node_id == peer.node_id:
                    await self._refused(t, why)
                elif t is None and self.on_stray_refuse is not None:
                    self.on_stray_refuse(rid, peer.node_id, why)
            case _:
                log.warning("dropping malformed message from %s", peer.node_id)

    async def _refused(self, t: Transfer, why: str) -> None:
        """A refusal (the decode node's, or ours: frames stuck) said once, not a second target
        asked. Only zero-copy ZeroMQ frames stick: no shm segment is lent while read."""
        if not t.answered:
            t.answered = True
            self.connector(t.backend).on_grant(t, None)
            await self.on_refuse(t.request_id, t.target.node_id, why)

    def _retire(self, peer: Peer, why: str = "closing") -> None:
        log.info("%s %s", peer.node_id, why)
        self.peers.pop(peer.node_id, None)
        for task in peer.tasks:
            task.cancel()
        peer.sock.close()

    async def close(self) -> None:
        for peer in list(self.peers.values()):
            self._retire(peer)
        for connector in self.connectors.values():
            await connector.close()


def _wait_all(trackers: list[Any], timeout: float) -> bool:
    """Worker thread: until ZeroMQ has let go of every tracked frame (False: not in time, a
    peer that reads nothing; its frames stay queued, and so they never complete)."""
    deadline = time.monotonic() + timeout
    try:
        for tracker in trackers:
            tracker.wait(max(0.0, deadline - time.monotonic()))
    except zmq.NotDone:
        return False
    return True
