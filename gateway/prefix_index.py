"""Which prefix blocks every node holds, from the KvEvents it publishes. Pure.

Each node's cache is a set of chained block hashes (equal hash = equal whole prefix of equal
KV, common/engine/block_manager.py), so the tokens of a request a node holds are the longest
run of the request's own block hashes found there. Events come in order per node (`seq` from
0); a gap means a batch was lost and the node's entry is stale until its next snapshot: it
counts as holding nothing meanwhile (cache-blind routing, never a wrong belief). A node that
leaves, dies or registers again loses its entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.wire.protocol import KvEvents


@dataclass
class _Held:
    blocks: set[bytes] = field(default_factory=set)
    next_seq: int = 0
    stale: bool = True  # until the first snapshot


class PrefixIndex:
    def __init__(self) -> None:
        self.nodes: dict[str, _Held] = {}

    def apply(self, msg: KvEvents) -> bool:
        """Take a node's events; False when one was lost (the node must send a snapshot)."""
        held = self.nodes.setdefault(msg.node_id, _Held())
        if msg.snapshot:
            held.blocks = set(msg.stored)
            held.stale = False
        elif held.stale or msg.seq != held.next_seq:
            held.stale = True  # a gap: what we know is wrong in unknown ways
            held.blocks.clear()
            held.next_seq = msg.seq + 1
            return False
        else:
            held.blocks.update(msg.stored)
            held.blocks.difference_update(msg.evicted)
        held.next_seq = msg.seq + 1
        return True

    def check(self, node_id: str, last_sent: int) -> None:
        """The node says its last KvEvents was `last_sent`: one we never got is lost."""
        held = self.nodes.get(node_id)
        if held is not None and last_sent >= held.next_seq:
            held.stale = True
            held.blocks.clear()

    def needs_snapshot(self, node_id: str) -> bool:
        held = self.nodes.get(node_id)
        return held is None or held.stale

    def drop(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def cached_blocks(self, node_id: str, hashes: Sequence[bytes]) -> int:
        """How many of the request's leading blocks the node holds."""
        held = self.nodes.get(node_id)
        if held is None or held.stale:
            return 0
        count = 0
        for digest in hashes:
            if digest not in held.blocks:
                break
            count += 1
        return count

    def holders(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Every node holding a leading part of the request: node id -> blocks."""
        out = {}
        for node_id in self.nodes:
            n = self.cached_blocks(node_id, hashes)
            if n:
                out[node_id] = n
        return out
