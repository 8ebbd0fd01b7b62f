"""The gateway's placement round, as the planner's simulation runs it.

Mirrors gateway/placement.py's round: every waiting request tries in the admission order,
each asks the gateway's own `choose` (gateway/plan.py) with the configured policy over the
nodes' views, and a prefill node answers an offer at once by its scheduler's `can_take`. A
node's answer tells how long a prompt it still takes this round (`Scheduler.room`, the real
node's `Reject.room`): longer prompts are not offered to it, and the round ends once no
prefill node takes anything. A request no node could take (its prompt longer than every
room, or its KV larger than every decode node's free blocks) is passed over without asking
the policy: nothing it could be offered would be accepted. An urgent one (gateway/admission.py
`urgent`) still asks, as the gateway's offers would, and if no node takes it keeps one of
those that said no free for it, as the gateway's `_reserve` does: a starvation guard.

Views are derived from each node's last report and the request table (gateway/plan.py
`view`) and kept until that node reports again (`forget`): within a round only the two nodes
of each placement change.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.gateway.admission import keep_for, order, urgent
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
        # by admission key, in arrival order (a re-placed one added again: last)
        self._waiting: dict[int, SimRequest] = {}
        self._lengths: list[tuple[int, int]] = []  # (tokens to prefill, key), sorted
        self._replaced: set[int] = set()  # keys of re-placed ones (urgent)

    def add(self, r: SimRequest) -> None:
        """A request waits (again)."""
        self._waiting[r.entry.key] = r
        bisect.insort(self._lengths, (_length(r), r.entry.key))
        if r.entry.resumed:
            self._replaced.add(r.entry.key)

    def remove(self, r: SimRequest) -> None:
        del self._waiting[r.entry.key]
        self._replaced.discard(r.entry.key)
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
        max_wait = cfg.admission_max_wait
        # only those that fit somewhere are ordered (the order is by a key per request, so
        # the others would only be passed over); room shrinks as the round goes on
        held = most_free * block_size - 1
        fit = bisect.bisect_right(self._lengths, (min(most, held), math.inf))
        waiting = [self._waiting[key] for _, key in self._lengths[:fit]]
        # and the first urgent ones no node's room fits (a decode node's blocks do): the first
        # to ask hears every node say no and keeps one; after it, no node is asked
        waiting += self._late(min(most, held), held, len(prefill))
        by_key = {r.entry.key: r for r in waiting}
        entries = [r.entry for r in waiting]
        told: set[str] = set()  # nodes whose room the gateway has heard this round
        for entry in order(cfg.admission, entries, sim.now, max_wait, cfg.admission_aging):
            if most <= 0:
                break
            r = by_key[entry.key]
            length = _length(r)
            blocks = -(-(length + 1) // block_size)
            hurry = urgent(entry, sim.now, max_wait)
            # an urgent one is offered to the nodes that have not said what they take yet
            if blocks > most_free or (length > most and not (hurry and len(told) < len(room))):
                continue
            need = Need(length, output_len=r.spec.max_tokens - len(r.req.output_ids))
            pairs = choose(
                sim.policy, [], [self._view(n) for n in decode], [self._view(n) for n in prefill],
                need,
            )  # fmt: skip
            refused: set[str] = set()  # the nodes that said no to it (offered: not told yet)
            for p, d in pairs:
                pid, did = p.node_id, d.node_id
                if room[pid] < length:  # it would reject this prompt
                    if pid not in told:
                        refused.add(pid)
                        told.add(pid)
                    continue
                pnode, dnode = sim.nodes[pid], sim.nodes[did]
                if pnode.sched.can_take(length, sim.policy.queueing) is not None:
                    room[pid] = self._room_of(pnode)
                    most = max(room.values())
                    refused.add(pid)
                    told.add(pid)
                    continue
                if blocks > free[did]:
                    continue
                self.commit(r, r.req.prompt_ids + r.req.output_ids, pnode, dnode)
                room[pid], free[did] = self._room_of(pnode), self._free_of(dnode)
                most, most_free = max(room.values()), max(free.values())
                break
            else:  # not placed
                if hurry and (kept := self._keep(r, refused, room, length)) is not None:
                    told.add(kept)
                    most = max(room.values())

    def _late(self, shortest: int, longest: int, count: int) -> list[SimRequest]:
        """The first `count` urgent requests in the admission order (re-placed ones, then
        the oldest) of more than `shortest` and at most `longest` tokens."""
        now, max_wait = self.sim.now, self.sim.cfg.admission_max_wait
        found = sorted(
            (r for k in self._replaced if shortest < _length(r := self._waiting[k]) <= longest),
            key=lambda r: r.entry.key,
        )[:count]
        for r in self._waiting.values():  # the others in arrival order: the oldest first
            if len(found) >= count or not (r.entry.resumed or urgent(r.entry, now, max_wait)):
                break
            if not r.entry.resumed and shortest < _length(r) <= longest:
                found.append(r)
        return found

    def _keep(
        self, r: SimRequest, refused: set[str], room: dict[str, int], length: int
    ) -> str | None:
        """The gateway's starvation guard (gateway/placement.py `_reserve`, one rule:
        admission.keep_for): an urgent request no node took keeps one that said no."""
        nodes = self.sim.nodes

        def capacity(n: str) -> int:
            return nodes[n].info.num_blocks * nodes[n].info.block_size

        r.kept = keep_for(r.kept, refused, room, capacity, length)
        return r.kept

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
