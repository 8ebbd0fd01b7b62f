"""The KV connector interface: how one backend moves a layer's frame from a prefill node's
paged cache to a decode node's. Everything else about a transfer (the KvHeader that reserves
blocks, the order of messages per peer, KvDone, KvAck/KvRefuse, leases and timeouts) is the
same for every backend and lives in sender.py and intake.py.

A backend is one module that defines a `SendConnector` (prefill side), a `ReceiveConnector`
(decode side) and `CONNECTOR = Backend(...)`, plus one line in `BACKENDS`
(common/kv_backends.py). docs/architecture.md walks through the tcp backend.

The life of a transfer, and what each side of a connector is asked:

    prefill (SendConnector)                       decode (ReceiveConnector)
    begin(t)      -> where the frames will be     open(rec)       header arrived: prepare
    stage(t, i)   engine thread: layer i's frame
    descriptor(t, i, payload)
                  -> ZeroMQ parts after the KvLayer message, or None: no descriptor at all
    send(t, i, payload)                           frame(rec, i, parts) -> the frame to land
                  out-of-band bytes, in order       (descriptor backends), or the backend
                                                    lands frames itself (tcp: FrameSink)
    end(t)        acked or aborted: give back     close()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.interface import KvStore
from pdserve.common.wire.address import EVERYWHERE
from pdserve.common.wire.kv_messages import (
    KvHeader,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
    Msg,
)
from pdserve.common.wire.security import ClusterKey


@dataclass
class Local:
    """What a connector knows of the node it runs in."""

    node_id: str
    host_id: str  # same value = same host and IPC namespace (common/node/host.py)
    advertise_host: str
    kv: KvStore  # the node's KV cache: every byte a connector moves goes through it
    data_address: str = ""  # decode: its ZeroMQ data socket (descriptors, and zmq's frames)
    timeout: float = 10.0  # a frame whose bytes stop this long has failed
    ports: dict[str, int] = field(default_factory=dict)  # decode: listener port per backend
    # (missing or 0: any free one)
    forced: str = "auto"  # the --kv-backend choice (a backend may listen only when chosen)
    key: ClusterKey | None = None  # --cluster-key: backends authenticate their peers with it
    max_tokens: int = 0  # the longest request's tokens (frames past it are refused); 0: the cache's
    listen: str = EVERYWHERE  # where listeners bind (loopback for a node reached only there)


@dataclass
class Transfer:
    """Prefill side: one request's KV on its way to one decode node."""

    request_id: str
    target: DecodeTarget
    backend: str
    block_table: list[int]
    num_tokens: int
    frame_bytes: int
    num_layers: int
    location: str = ""  # backend-specific, sent in the header (shm: the segment's name)
    state: Any = None  # the backend's own (shm: the segment)
    started: float = field(default_factory=time.monotonic)  # header sent
    first_byte: float = 0.0  # the first layer's frame queued to the wire
    prefill_end: float = 0.0  # the forward pass was over (set by the prefill node)
    layerwise: bool = False  # its layers went out during the pass (prefill_node/layerwise.py)
    staged: list[Any] = field(default_factory=list)  # host copies sent, returned at the end
    finished: float = 0.0  # KvAck received
    # the decode node acknowledged or refused it: it reads none of its frames any more (an
    # abort is not answered: shm destroys the segment rather than lend it again)
    answered: bool = False
    # stages in flight off the event loop (a fetch, a resend: common/kv/sender.py), and
    # whether the transfer was released meanwhile: its backend state outlives those stages
    staging: int = 0
    ended: Any = None  # released: the event loop to end it on once no stage is in flight
    trackers: list[Any] = field(default_factory=list)  # zero-copy ZeroMQ frames not yet out

    @property
    def total_bytes(self) -> int:
        return self.frame_bytes * self.num_layers

    @property
    def seconds(self) -> float:
        """The transfer: first KV byte out to the acknowledgement."""
        return self.finished - (self.first_byte or self.started)

    @property
    def overlap(self) -> float:
        """Of `seconds`, the part that ran while the forward pass still computed (layer-wise
        sending hides it; what is left after the pass is the exposed transfer)."""
        first = self.first_byte or self.started
        return max(0.0, min(self.prefill_end or first, self.finished) - first)


@dataclass
class Intake:
    """Decode side: one request's KV arriving into reserved blocks."""

    header: KvHeader
    peer: bytes  # the prefill node's data-socket identity
    block_table: list[int]
    started: float = field(default_factory=time.monotonic)
    progress: float = 0.0  # last frame landed (or KvDone); 0 until the first
    layers: set[int] = field(default_factory=set)
    bytes_in: int = 0
    first_token: int | None = None  # from KvDone
    dropped: bool = False  # refused or aborted (kept only while its frames must drain)
    receiving: bool = False  # a frame is landing in its blocks right now
    state: Any = None  # the backend's own (shm: the mapped segment; tcp: a scratch buffer)

    @property
    def complete(self) -> bool:
        return self.first_token is not None and len(self.layers) == self.header.num_layers


# what ReceiveConnector.frame returns when the sender wrote the frame into the cache itself
LANDED = object()


class SendConnector:
    """Prefill side of a backend. One instance per node; called from the event loop, except
    `stage` (engine thread)."""

    # `send` runs before the descriptor goes out: the frame must be in place when the
    # receiver hears of it (a sender that writes into the receiver's memory itself)
    writes_first = False

    def __init__(self, local: Local) -> None:
        self.local = local

    def usable(self, endpoint: str) -> bool:
        """Whether frames can reach a decode node that advertised `endpoint` for us."""
        return bool(endpoint)

    def begin(self, t: Transfer) -> None:
        """The header is about to go out: set `t.location` if the receiver needs it."""

    def stage(self, t: Transfer, layer: int) -> Any:
        """Engine thread, as layer `layer` lands in the cache: what `descriptor`/`send` need
        (views of the cache to send without a copy, a staged frame, or nothing)."""
        return self.local.kv.export_parts(layer, t.block_table, t.num_tokens)

    def descriptor(self, t: Transfer, layer: int, payload: Any) -> list[Any] | None:
        """ZeroMQ parts to send after the layer's KvLayer message, in order with every other
        message to that peer; None: no KvLayer message at all (a self-describing stream)."""
        return []

    async def send(self, t: Transfer, layer: int, payload: Any) -> None:
        """In the peer's ordered sender task, after the descriptor: bytes that travel outside
        ZeroMQ. Raise OSError when they cannot, or hand them to a writer of the backend's own
        (tcp) that logs its failures: either way the decode side refuses the transfer."""

    async def settle(self, t: Transfer) -> None:
        """Until every frame `send` took for `t` has been read out of its views (written,
        or failed): its KvDone waits for it (common/kv/sender.py `_settled`)."""

    def on_grant(self, t: Transfer, grant: Any) -> None:
        """The receiver answered the header with where to write (KvGrant), or refused the
        transfer (None)."""

    def end(self, t: Transfer) -> None:
        """The transfer is over (acknowledged, refused and redirected, or aborted: then
        `t.answered` is False, and the receiver may still read what was sent)."""

    async def close(self) -> None:
        """The node stops."""


class ReceiveConnector:
    """Decode side of a backend. One instance per node, on its event loop."""

    # frames keep coming after a refusal and must still be received (ucx: a send waits for it)
    drains_after_drop = False

    def __init__(self, local: Local) -> None:
        self.local = local

    async def listen(self, sink: Any) -> str:
        """Start receiving; the endpoint peers should use ("" when this node does not offer
        the backend). `sink` is the intake's `landing` (a landing.FrameSink), for backends
        that land frames themselves."""
        return ""

    def open(self, rec: Intake) -> str | None:
        """A header arrived with reserved blocks: prepare; a reason to refuse, or None."""
        return None

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        """The frame behind a KvLayer descriptor (ZeroMQ parts that followed it): a buffer, or
        parts whose concatenation is the frame; None if it is missing."""
        return parts or None

    def grant(self, rec: Intake, block_table: list[int]) -> Msg | None:
        """After `open`: a message telling the sender where to write (`block_table`: the
        blocks its frames fill), or None."""
        return None

    def revoke(self, rec: Intake) -> bool:
        """Before the reservation's blocks are given back: may they be? False while the
        sender may still be writing into them (asked again on the intake's next tick)."""
        return True

    def close_intake(self, rec: Intake) -> None:
        """The transfer is over on this side."""

    async def close(self) -> None:
        """The node stops."""


@dataclass(frozen=True)
class Backend:
    name: str
    send: Callable[[Local], SendConnector]
    receive: Callable[[Local], ReceiveConnector]
    auto_rank: int | None = None  # `auto` takes the usable backend of lowest rank; None:
    # only when asked for by name
