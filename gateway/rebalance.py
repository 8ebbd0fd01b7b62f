"""Rebalancing the decode pool by live migration (`--rebalance U`). Pure: `now` passed in.

A decode node whose KV cache is more than U in use will soon preempt: when a running
sequence cannot grow, the newest one is handed back and recomputed elsewhere, its prefill
and every decode step spent again. Placement cannot prevent this, because it only sees the
prompt: sequences grow after they are placed, unevenly. So the gateway watches the pool
and, when the fullest decode node is past U and the emptiest is at least `GAP` emptier,
asks the fuller one to move some running sequences to the other with their KV (`Rebalance`
-> the node's `Migrate` -> `Redirect`: the drain's path, decode_node/server.py), with no
token lost, repeated or recomputed.

Which ones: those with the most growth left (max_tokens not yet generated), since the ones
about to finish free their blocks soon anyway; as many as bring the two nodes halfway
together, at most `MOST` a round, only what fits in the target's free blocks, and never
one whose move would leave the target past U and `GAP` fuller than the source (the next
round would move it back: one large sequence bounced between two nodes). A node
rebalanced less than `COOLDOWN` seconds ago is left alone: its load reports must show the
moves before the rule looks again, or it would move twice as much (hysteresis); and what is
still on its way off it (its blocks in the source's reports until the target acknowledges
the KV: longer than the cooldown for a large sequence) counts as gone already.

`Rebalance` names only the sequences; each comes back as the node's `Migrate`, and the
gateway sends it to the target chosen here while it fits there (`Planned`). Left to the
placement policy, which prefers the node caching most of a prefix, the moves went to another
full node holding a shared system prompt, and the next round moved them back, the empty
node getting nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.gateway.policies import NodeView
from pdserve.gateway.table import Phase, RequestTable

GAP = 0.25  # usage difference (share of blocks) worth moving KV across
MOST = 4  # sequences moved per round
COOLDOWN = 2.0  # seconds between rounds on one source node
PLANNED_S = 10.0  # how long a move's target waits for its Migrate (it comes within a step)


@dataclass(frozen=True)
class Move:
    source: str  # node id
    target: str  # the emptiest node: where each goes while it fits there (`Planned`)
    request_ids: tuple[str, ...]  # wire ids


def usage(view: NodeView) -> float:
    total = view.node.info.num_blocks
    return 1.0 - view.free_blocks / total if total else 0.0


def choose(
    decode: list[NodeView],
    table: RequestTable,
    high: float,
    last: dict[str, float],
    now: float,
) -> Move | None:
    """The sequences to move this round, or None. `last`: when each node was last a source."""
    # a node that refused KV since its report shows no free block (plan.base_view): its
    # next report says what it holds; a mostly empty one would be taken for the fullest
    decode = [v for v in decode if v.node.refused_at < v.node.load_at]
    if high <= 0 or len(decode) < 2:
        return None
    source = max(decode, key=usage)
    target = min(decode, key=usage)
    u_src, u_dst = usage(source), usage(target)
    if u_src < high or u_src - u_dst < GAP or now - last.get(source.node_id, -1e9) < COOLDOWN:
        return None
    block = source.block_size
    u_src -= _leaving(table, source.node_id, block) / source.node.info.num_blocks
    if u_src < high or u_src - u_dst < GAP:
        return None
    running = []
    for a in table.headed_to(source.node_id):
        moving = a.prefill is not None  # a migration (or its first transfer) in flight
        if moving or a.phase is not Phase.DECODE or not a.delivered_at or a.req.finished:
            continue
        size = a.kv_len + 1  # +1: its newest token, sent with the KV
        running.append((a.final_len - size, size, a.wire_id))
    running.sort(reverse=True)  # most growth left first
    want = (u_src - u_dst) / 2 * source.node.info.num_blocks  # blocks to bring them halfway
    room = target.free_blocks
    n_src, n_dst = source.node.info.num_blocks, target.node.info.num_blocks
    picked: list[str] = []
    moved = 0
    for _, size, wire_id in running:
        blocks = -(-size // block)
        if len(picked) >= MOST or moved >= want:
            break
        if blocks + 1 > room - moved:  # +1: its next token's block on the target
            continue
        after = moved + blocks
        d2, s2 = u_dst + after / n_dst, u_src - after / n_src
        if d2 >= high and d2 - s2 >= GAP:
            continue  # the target past `high`, the gap turned: the next round moves it back
        picked.append(wire_id)
        moved += blocks
    if not picked:
        return None
    return Move(source.node_id, target.node_id, tuple(picked))


def _leaving(table: RequestTable, node_id: str, block: int) -> int:
    """Blocks of the sequences moving off `node_id` (the table holds the old node as a
    migration's "prefill" side until its KvTransferred)."""
    total = 0
    for a in table.on_node(node_id):
        if a.prefill == node_id and a.decode not in (None, node_id) and not a.req.finished:
            total += -(-(a.kv_len + 1) // block)
    return total


class Planned:
    """The targets of this gateway's moves, by wire id, until each sequence's `Migrate`
    asks where it goes or `PLANNED_S` passes. Pure: `now` passed in."""

    def __init__(self) -> None:
        self._to: dict[str, tuple[str, float]] = {}  # wire id -> (target, until)

    def remember(self, move: Move, now: float) -> None:
        self._to = {rid: got for rid, got in self._to.items() if got[1] > now}
        for rid in move.request_ids:
            self._to[rid] = (move.target, now + PLANNED_S)

    def take(self, wire_id: str, now: float) -> str | None:
        got = self._to.pop(wire_id, None)
        return got[0] if got is not None and got[1] > now else None
