"""Writing KV straight into a peer's paged cache: the part shared by shm_direct (CPU, the
cache in /dev/shm) and cuda_ipc (GPU, the cache shared by a CUDA IPC handle).

The receiver advertises `host_id|cache|grants|layout`, where `cache` is what a writer needs
to map its cache (a file path, an IPC handle). Per transfer the writer waits for the
receiver's `KvGrant` (the blocks it reserved), then copies each layer from its own blocks
into those under the grant's lock (grants.py), and only then sends the layer's descriptor;
the receiver takes the descriptor as "landed" (LANDED) and revokes the grant before its
blocks go back. A subclass says how a cache is shared (`share`), mapped (`attach`) and
copied into (`copy`); the rest, including every safety rule, is here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.kv.base import (
    LANDED,
    Intake,
    Local,
    ReceiveConnector,
    SendConnector,
    Transfer,
)
from pdserve.common.kv.grants import GrantTable, GrantView
from pdserve.common.wire.kv_messages import (
    KvGrant,
)
from pdserve.common.wire.protocol import (
    Msg,
)

SEP = "|"
log = logging.getLogger(__name__)


def cache_of(local: Local) -> KVCache | None:
    """The node's paged cache as a tensor (torch engines); None for engines without one."""
    return local.kv if isinstance(local.kv, KVCache) else None


def layout_text(cache: KVCache) -> str:
    return ",".join(str(x) for x in cache.layout)


def same_kind(a: str, b: str) -> bool:
    """Whether two layouts hold the same KV (all but the number of blocks agree)."""
    x, y = a.split(","), b.split(",")
    return len(x) == len(y) == 6 and x[:1] + x[2:] == y[:1] + y[2:]


@dataclass
class Peer:
    """A receiver's cache as this writer sees it."""

    cache: KVCache
    grants: GrantView


@dataclass
class Direct:
    """One transfer's state on the writer's side."""

    peer: Peer
    granted: asyncio.Future[KvGrant | None] = field(  # None: refused or over
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    closed: bool = False


class DirectSend(SendConnector):
    name = ""  # the backend's name (its key in a peer's kv_endpoints)
    writes_first = True

    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.peers: dict[str, Peer] = {}  # by endpoint: a restarted node has a new one
        self.by_node: dict[str, str] = {}  # node id -> its endpoint
        self.swept = 0.0  # mappings of gone caches last let go

    # -- what a subclass says ---------------------------------------------------------------
    def can_write(self, own: KVCache, shared: str) -> bool:
        """Whether this node's cache can write into a cache shared as `shared`."""
        raise NotImplementedError

    def attach(self, shared: str, layout: tuple[int, ...], dtype: str) -> Any:
        """The peer's cache tensor, of `layout` (the KVCache data shape) and `dtype`."""
        raise NotImplementedError

    def gone(self, shared: str) -> bool:
        """Whether the cache shared as `shared` is no more (its file unlinked)."""
        return False

    def mark(self, t: Transfer, layer: int) -> Any:
        """Engine thread, as the layer lands: what `copy` must wait for (a CUDA event)."""
        return None

    def copy(self, own: KVCache, t: Transfer, layer: int, dst: KVCache, table: list[int],
             mark: Any) -> None:  # fmt: skip
        """Worker thread, under the grant's lock: the layer into `dst`, finished on return."""
        own.copy_into(layer, t.block_table, t.num_tokens, dst, table)

    # -- the protocol -------------------------------------------------------------------------
    def usable(self, endpoint: str) -> bool:
        parts = endpoint.split(SEP)
        own = cache_of(self.local)
        if len(parts) != 4 or own is None or parts[0] != self.local.host_id:
            return False
        if not same_kind(parts[3], layout_text(own)) or not self.can_write(own, parts[1]):
            return False
        try:
            self._peer(endpoint)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError):
            return False  # gone (restarted), not mappable here or malformed: another backend
        return True

    def _peer(self, endpoint: str) -> Peer:
        self._forget_gone()
        peer = self.peers.get(endpoint)
        if peer is None:
            _, shared, grants, layout = endpoint.split(SEP)
            layers, blocks, bs, heads, dim, dtype = layout.split(",")
            shape = (int(layers), 2, int(blocks) * int(bs), int(heads), int(dim))
            data = self.attach(shared, shape, dtype)
            cache = KVCache(shape[0], int(blocks), int(bs), shape[3], shape[4], data.dtype,
                            data.device, data=data)  # fmt: skip
            peer = Peer(cache, GrantView(grants))
            if len(self.peers) >= 64:  # long gone peers: forget the oldest mapping
                self.peers.pop(next(iter(self.peers)))
            self.peers[endpoint] = peer
        return peer

    def _forget_gone(self) -> None:
        """Let go of caches whose file is gone: a node restarted under a new id (its pid in
        it, outside Docker) left its old cache's memory pinned by the mapping, and its
        successor, finding /dev/shm short, kept its cache private, so no new mapping came."""
        now = time.monotonic()
        if now - self.swept < 1.0:  # a stat per mapped peer, not on every transfer
            return
        self.swept = now
        for e in [e for e in self.peers if self.gone(e.split(SEP)[1])]:
            del self.peers[e]

    def begin(self, t: Transfer) -> None:
        endpoint = t.target.kv_endpoints[self.name]
        old = self.by_node.get(t.target.node_id)
        if old is not None and old != endpoint:  # the node restarted with a new cache: let
            self.peers.pop(old, None)  # the old mapping go (it would pin its memory)
        self.by_node[t.target.node_id] = endpoint
        t.state = Direct(self._peer(endpoint))

    def stage(self, t: Transfer, layer: int) -> Any:
        return self.mark(t, layer)  # the layer stays in our cache until `send` copies it

    def on_grant(self, t: Transfer, grant: Any) -> None:
        """The grant, or None: the header was refused (the layers queued behind it give way
        at once rather than wait out the timeout)."""
        if isinstance(t.state, Direct) and not t.state.granted.done():
            t.state.granted.set_result(grant if isinstance(grant, KvGrant) else None)

    async def send(self, t: Transfer, layer: int, payload: Any) -> None:
        state: Direct = t.state
        if state is None or state.closed:
            raise OSError("transfer over")
        try:
            grant = await asyncio.wait_for(asyncio.shield(state.granted), self.local.timeout)
        except asyncio.TimeoutError:  # the header or its grant was lost: the layers behind
            self.end(t)  # it give way at once (this peer's channel must not wait per layer)
            raise OSError(f"{t.request_id}: no grant within {self.local.timeout:.0f} s") from None
        if grant is None:
            raise OSError(f"{t.request_id}: no grant (refused or over)")
        if not await asyncio.to_thread(self._write, t, state, grant, layer, payload):
            raise OSError(f"grant of {t.request_id} revoked")

    def _write(self, t: Transfer, state: Direct, grant: KvGrant, layer: int, mark: Any) -> bool:
        own = cache_of(self.local)
        assert own is not None
        dst, table = state.peer.cache, grant.block_table
        if len(table) * own.block_size < t.num_tokens or not all(
            0 <= b < dst.num_blocks for b in table
        ):
            return False  # not a grant this transfer can use
        with state.peer.grants.hold(grant.ticket, grant.nonce) as valid:
            if not valid or state.closed:
                return False
            self.copy(own, t, layer, dst, table, mark)
            # ended while copying (its request dropped): its source blocks may have gone to
            # another sequence's pass meanwhile, so this layer is never announced and the
            # receiver refuses the transfer at its KvDone (they are freed only after `closed`)
            return not state.closed

    def end(self, t: Transfer) -> None:
        if isinstance(t.state, Direct):
            t.state.closed = True
            self.on_grant(t, None)


class DirectReceive(ReceiveConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.grants: GrantTable | None = None

    def share(self, cache: KVCache) -> str | None:
        """How a writer on this host maps this node's cache; None: it cannot."""
        raise NotImplementedError

    async def listen(self, sink: Any) -> str:
        cache = cache_of(self.local)
        shared = self.share(cache) if cache is not None else None
        if cache is None or shared is None:
            return ""  # peers use another backend
        self.grants = GrantTable()
        return SEP.join((self.local.host_id, shared, self.grants.path, layout_text(cache)))

    def open(self, rec: Intake) -> str | None:
        ticket = self.grants.grant() if self.grants is not None else None
        if ticket is None:
            return "no write grant free" if self.grants is not None else "no shared KV cache"
        rec.state = ticket
        return None

    def grant(self, rec: Intake, block_table: list[int]) -> Msg | None:
        ticket, nonce = rec.state
        return KvGrant(
            request_id=rec.header.request_id, ticket=ticket, nonce=nonce, block_table=block_table
        )

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        return LANDED  # the writer copied it in before it sent the descriptor

    def revoke(self, rec: Intake) -> bool:
        if rec.state is None or self.grants is None:
            return True
        if not self.grants.revoke(rec.state[0]):
            return False
        rec.state = None
        return True

    async def close(self) -> None:
        """Every grant closed, writers inside a layer waited for (the cache may go on to the
        node's next role with other blocks in use), then the grant file removed."""
        if self.grants is not None:
            grants, self.grants = self.grants, None
            left = await asyncio.to_thread(grants.close)
            if left:
                log.warning("%d KV writers still inside their grants at close", left)
