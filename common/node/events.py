"""A node's prefix cache as the gateway's index sees it: the blocks stored and evicted since
the last heartbeat, as numbered `KvEvents`, or the whole cache when the gateway lost track
(a new gateway, a lost message: `resync`). The first message rides in the heartbeat (one
message per node per gateway per interval, not two); a snapshot's other parts follow it."""

from __future__ import annotations

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.wire.protocol import KvEvents

MAX_HASHES = 4096  # per KvEvents message


class PrefixEvents:
    def __init__(self, node_id: str, blocks: BlockManager, enabled: bool) -> None:
        self.node_id, self.blocks, self.enabled = node_id, blocks, enabled
        self.events_seq = 0  # KvEvents sent since start
        self.snapshot_due = True  # the gateway knows nothing of our prefix cache yet

    def resync(self) -> None:
        self.snapshot_due = True

    def seq(self) -> int:
        """The seq of the last KvEvents sent (-1: none)."""
        return self.events_seq - 1

    def take(self) -> list[KvEvents]:
        """Stored and evicted prefix blocks since the last call, as numbered KvEvents of at
        most `MAX_HASHES` hashes; the whole cache when the gateway needs a snapshot."""
        if not self.enabled:
            return []
        events, lost = self.blocks.take_events()
        if lost or self.snapshot_due:
            self.snapshot_due = False
            hashes = self.blocks.cached_hashes()
            out = [self._msg(hashes[:MAX_HASHES], [], snapshot=True)]
            for i in range(MAX_HASHES, len(hashes), MAX_HASHES):
                out.append(self._msg(hashes[i : i + MAX_HASHES], []))
            return out
        final = {h: stored for stored, h in events}  # a hash's last event in the batch counts
        stored = [h for h, s in final.items() if s]
        evicted = [h for h, s in final.items() if not s]
        return [
            self._msg(stored[i : i + MAX_HASHES], evicted[i : i + MAX_HASHES])
            for i in range(0, max(len(stored), len(evicted)), MAX_HASHES)
        ]

    def _msg(self, stored: list[bytes], evicted: list[bytes], snapshot: bool = False
             ) -> KvEvents:  # fmt: skip
        msg = KvEvents(node_id=self.node_id, seq=self.events_seq, stored=stored, evicted=evicted,
                       snapshot=snapshot)  # fmt: skip
        self.events_seq += 1
        return msg
