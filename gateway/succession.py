"""A node restarted under its own id. Pure; `now` is passed in.

A supervisor, compose or Kubernetes restarts a crashed node process with the same
`--node-id`, and the new process registers before the old one's lease has run out. Each
process has its own control identity (node id + a per-process suffix), so the gateway sees
two processes claiming one id: a restart (the old one is dead) or a twin (two live processes
given one id by mistake). The old one's heartbeats tell them apart:

- silent for twice its own heartbeat gap (or half the lease, if shorter): it is dead. The
  newcomer replaces it at once: the old one's requests are placed again now, not at the
  lease's end (docs/architecture.md, "Losing a node").
- heard lately: no answer yet. The newcomer's next heartbeat is answered `unknown_node`, so
  it registers again, and is judged again, every beat.
- heard for a whole lease after the newcomer first asked: a twin. Refused as a duplicate id;
  the first process keeps it.

A woken old process (SIGSTOP, a swap storm) finds itself unknown, registers again, and is
refused by the same rule once the new one has been heard for a lease.
"""

from __future__ import annotations

from enum import Enum

from pdserve.gateway.cluster import ClusterView

MAX_WAITING = 256  # newcomers remembered; one per registered id at most in practice


class Verdict(Enum):
    JOIN = "join"  # as any Register: ClusterView.register accepts or refuses it
    REPLACE = "replace"  # drop the old process first, then register this one
    WAIT = "wait"  # no answer now: the node asks again at its next heartbeat


class Succession:
    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster
        # node id -> (the newcomer's identity, when it first asked)
        self.waiting: dict[str, tuple[bytes, float]] = {}

    def verdict(self, node_id: str, identity: bytes, now: float) -> Verdict:
        old = self.cluster.nodes.get(node_id)
        if old is None or old.identity == identity:
            self.waiting.pop(node_id, None)
            return Verdict.JOIN
        gap = old.beat_gap or self.cluster.heartbeat_timeout / 4  # no heartbeat yet
        quiet = min(self.cluster.heartbeat_timeout / 2, 2 * gap)
        if now - old.last_seen > quiet:
            self.waiting.pop(node_id, None)
            return Verdict.REPLACE
        first = self.waiting.get(node_id)
        if first is None or first[0] != identity:
            self._prune()
            first = self.waiting[node_id] = (identity, now)
        if now - first[1] < self.cluster.heartbeat_timeout:
            return Verdict.WAIT
        del self.waiting[node_id]
        return Verdict.JOIN  # the old one answered for a whole lease: a twin, refused

    def _prune(self) -> None:
        if len(self.waiting) >= MAX_WAITING:  # ids no longer registered, then the oldest
            for node_id in [n for n in self.waiting if n not in self.cluster.nodes]:
                del self.waiting[node_id]
            while len(self.waiting) >= MAX_WAITING:
                del self.waiting[next(iter(self.waiting))]
