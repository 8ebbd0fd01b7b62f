"""The gateway's placement round, as the planner's simulation runs it.

Mirrors gateway/placement.py's round: every waiting request tries in the admission order,
each asks the gateway's own `choose` (gateway/plan.py) with the configured policy over the
nodes' views, and a prefill node answers an offer at once by its scheduler's `can_take`. A
node's answer tells how long a prompt it still takes this round (`Scheduler.room`, the real
node's `Reject.room`): longer prompts are not offered to it, and the round ends once no
prefill node takes anything. A request no node could take (its prompt longer than every
room, or its KV larger than every decode node's free blocks) is passed over without asking
the policy: nothing it could be offered would be accepted.

Views are derived from each node's last report and the request table (gateway/plan.py
`view`) and kept until that node reports again (`forget`): within a round only the two nodes
of each placement change.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.gateway.admission import order
from pdserve.gateway.plan import choose, view
from pdserve.gateway.policies import Need, NodeView

if TYPE_CHECKING:
    from pdserve.planner.sim import ClusterSim
    from pdserve.planner.simnodes import SimNode, SimRequest


class Rounds:
    def __init__(
        self, sim: ClusterSim, commit: Callable[[SimRequest, list[int], SimNode, SimNode], None]
    ) -> None:
        self.sim = sim
        self.commit = commit
        self._views: dict[str, NodeView] = {}
        self._room: dict[str, int] = {}  # prefill node -> longest prompt it takes now
        self._waiting: dict[int, SimRequest] = {}  # by admission key
        self._lengths: list[tuple[int, int]] = []  # (tokens to prefill, key), sorted

    def add(self, r: SimRequest) -> None:
        """A request waits (again)."""
        self._waiting[r.entry.key] = r
        bisect.insort(self._lengths, (_length(r), r.entry.key))

    def remove(self, r: SimRequest) -> None:
        del self._waiting[r.entry.key]
        item = (_length(r), r.entry.key)
        at = bisect.bisect_left(self._lengths, item)
        assert self._lengths[at] == item
        del self._lengths[at]

    def forget(self, node_id: str) -> None:
        """The node's state changed (it reported, or its scheduler took work)."""
        self._views.pop(node_id, None)
        self._room.pop(node_id, None)

    def run(self) -> None:
        sim = self.sim
        if not sim.waiting:
            return
        prefill = [n for n in sim.nodes.values() if n.info.role == "prefill"]
        decode = [n for n in sim.nodes.values() if n.info.role == "decode"]
        room = {n.info.node_id: self._room_of(n) for n in prefill}
        most = max(room.values(), default=0)
        if most <= 0:
            return  # no prefill node takes anything now: nothing to order
        free = {n.info.node_id: self._free_of(n) for n in decode}
        most_free = max(free.values(), default=-1)
        block_size = decode[0].info.block_size if decode else 1
        cfg = sim.cfg
        # only those that fit somewhere are ordered (the order is by a key per request, so
        # the others would only be passed over); room shrinks as the round goes on
        longest = min(most, most_free * block_size - 1)
        fit = self._lengths[: bisect.bisect_right(self._lengths, (longest, math.inf))]
        waiting = [self._waiting[key] for _, key in fit]
        by_key = {r.entry.key: r for r in waiting}
        entries = [r.entry for r in waiting]
        for entry in order(
            cfg.admission, entries, sim.now, cfg.admission_max_wait, cfg.admission_aging
        ):
            if most <= 0:
                break
            r = by_key[entry.key]
            length = _length(r)
            blocks = -(-(length + 1) // block_size)
            if length > most or blocks > most_free:
                continue
            need = Need(length, output_len=r.spec.max_tokens - len(r.req.output_ids))
            pairs = choose(
                sim.policy, [], [self._view(n) for n in decode], [self._view(n) for n in prefill],
                need,
            )  # fmt: skip
            for p, d in pairs:
                pid, did = p.node_id, d.node_id
                if room[pid] < length:
                    continue  # it would reject this prompt
                pnode, dnode = sim.nodes[pid], sim.nodes[did]
                if pnode.sched.can_take(length, sim.policy.queueing) is not None:
                    room[pid] = self._room_of(pnode)
                    most = max(room.values())
                    continue
                if blocks > free[did]:
                    continue
                self.commit(r, r.req.prompt_ids + r.req.output_ids, pnode, dnode)
                room[pid], free[did] = self._room_of(pnode), self._free_of(dnode)
                most, most_free = max(room.values()), max(free.values())
                break

    def _view(self, node: SimNode) -> NodeView:
        node_id = node.info.node_id
        got = self._views.get(node_id)
        if got is None:
            state = self.sim.cluster.nodes[node_id]
            got = self._views[node_id] = view(state, self.sim.table)
        return got

    def _room_of(self, node: SimNode) -> int:
        node_id = node.info.node_id
        got = self._room.get(node_id)
        if got is None:
            got = self._room[node_id] = node.sched.room(self.sim.policy.queueing)
        return got

    @staticmethod
    def _free_of(node: SimNode) -> int:
        sched = node.sched
        return sched.block_manager.num_free_blocks - sched.cfg.watermark_blocks


def _length(r: SimRequest) -> int:
    """The tokens a placement prefills: a re-placement recomputes prompt and output."""
    return len(r.req.prompt_ids) + len(r.req.output_ids)
