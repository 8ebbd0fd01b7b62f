"""A node's prefix cache as the gateway's index sees it: the blocks stored and evicted since
the last heartbeat, as numbered `KvEvents`, or the whole cache when the gateway lost track
(a new gateway, a lost message: `resync`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.wire.protocol import KvEvents, Msg

MAX_HASHES = 4096  # per KvEvents message


class PrefixEvents:
    def __init__(
        self,
        node_id: str,
        blocks: BlockManager,
        enabled: bool,
        send: Callable[[Msg], Awaitable[None]],
    ) -> None:
        self.node_id, self.blocks, self.enabled, self.send = node_id, blocks, enabled, send
        self.events_seq = 0  # KvEvents sent since start
        self.snapshot_due = True  # the gateway knows nothing of our prefix cache yet

    def resync(self) -> None:
        self.snapshot_due = True

    def seq(self) -> int:
        """The seq of the last KvEvents sent (-1: none)."""
        return self.events_seq - 1

    async def publish(self) -> None:
        """Stored and evicted prefix blocks since the last call, as KvEvents of at most
        `MAX_HASHES` hashes; the whole cache when the gateway needs a snapshot."""
        if not self.enabled:
            return
        events, lost = self.blocks.take_events()
        if lost or self.snapshot_due:
            self.snapshot_due = False
            hashes = self.blocks.cached_hashes()
            await self._send(hashes[:MAX_HASHES], [], snapshot=True)
            for i in range(MAX_HASHES, len(hashes), MAX_HASHES):
                await self._send(hashes[i : i + MAX_HASHES], [])
            return
        final = {h: stored for stored, h in events}  # a hash's last event in the batch counts
        stored = [h for h, s in final.items() if s]
        evicted = [h for h, s in final.items() if not s]
        for i in range(0, max(len(stored), len(evicted)), MAX_HASHES):
            await self._send(stored[i : i + MAX_HASHES], evicted[i : i + MAX_HASHES])

    async def _send(self, stored: list[bytes], evicted: list[bytes], snapshot: bool = False
                    ) -> None:  # fmt: skip
        msg = KvEvents(node_id=self.node_id, seq=self.events_seq, stored=stored, evicted=evicted,
                       snapshot=snapshot)  # fmt: skip
        self.events_seq += 1
        await self.send(msg)
