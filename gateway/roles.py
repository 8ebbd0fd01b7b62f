"""Live role switching (`--role-switching on`): when one pool is short of nodes and the
other has one to spare, a node of the second takes the first's role. Pure: `now` passed in.

Short and spare come from the autoscaling signal (gateway/sizing.py): the replicas each
pool needs for its load now, against the replicas it has (nodes registered, not draining).
A switch toward prefill needs the prefill pool short (desired > nodes) and the decode pool
able to lose one (desired <= nodes - 1, at least one left); toward decode, the mirror.

Hysteresis, so that it never flaps: the same imbalance must hold for `hold` seconds without
a break (a load oscillating faster than that switches nothing); a node keeps a role at least
`dwell` seconds from its first registration in it (a repeat from the same process says how
long ago that was); one switch at a time, and `cooldown` seconds between two. The node
switched is the one with least work to move: the decode node running fewest sequences, or
the prefill node with fewest prompts in prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.gateway.cluster import ClusterView, NodeState


@dataclass(frozen=True)
class Switch:
    node_id: str
    role: str  # the role it takes
    why: str


@dataclass
class RoleSwitcher:
    hold: float = 5.0
    dwell: float = 30.0
    cooldown: float = 10.0
    since: float | None = None  # when the current imbalance began
    toward: str | None = None  # the role it calls for
    last_switch: float = -1e9
    registered_at: dict[str, float] = field(default_factory=dict)  # node id -> in its role
    # node id -> (switches failed in a row, no donor before): a node whose new role cannot
    # start (it crashes, its supervisor restarts it in the old one, idle, the first donor
    # again) is not asked again every dwell, but after 2, 4, 8... dwells (an hour at most)
    failures: dict[str, tuple[int, float]] = field(default_factory=dict)

    def registered(
        self, node_id: str, now: float, switched: bool = False, served: float = 0.0
    ) -> None:
        """`served`: seconds the process has been in this role since its first registration
        (`Register.served_s`): a repeat keeps its dwell; a new process (0) starts it anew."""
        since = now - served if 0.0 < served < math.inf else now
        # a registration past the dwell holds nothing back (as none would): forgotten, or
        # pod churn (new node ids) grows it
        kept = self.registered_at.items()
        self.registered_at = {n: at for n, at in kept if now - at < self.dwell and n != node_id}
        if now - since < self.dwell:
            self.registered_at[node_id] = since
        if switched:
            self.failures.pop(node_id, None)

    def failed(self, node_id: str, now: float) -> None:
        for gone in [n for n, (_, until) in self.failures.items() if until + 3600.0 < now]:
            del self.failures[gone]  # nodes long gone (pod churn): not kept for good
        count = self.failures.get(node_id, (0, 0.0))[0] + 1
        self.failures[node_id] = (count, now + min(self.dwell * 2**count, 3600.0))

    def decide(
        self,
        cluster: ClusterView,
        desired: dict[str, int],
        in_prefill: dict[str, int],
        switching: bool,
        now: float,
    ) -> Switch | None:
        prefill, decode = cluster.alive("prefill"), cluster.alive("decode")
        toward = None
        if desired["prefill"] > len(prefill) and desired["decode"] <= len(decode) - 1:
            toward = "prefill"
        elif desired["decode"] > len(decode) and desired["prefill"] <= len(prefill) - 1:
            toward = "decode"
        if toward != self.toward:
            self.toward, self.since = toward, now if toward is not None else None
        if toward is None or self.since is None or switching:
            return None
        if now - self.since < self.hold or now - self.last_switch < self.cooldown:
            return None
        donors = decode if toward == "prefill" else prefill
        ready = [
            n for n in donors
            if now - self.registered_at.get(n.node_id, -1e9) >= self.dwell
            and now >= self.failures.get(n.node_id, (0, 0.0))[1]
        ]  # fmt: skip
        if not ready:
            return None

        def work(n: NodeState) -> int:
            return n.load.running if toward == "prefill" else in_prefill.get(n.node_id, 0)

        node = min(ready, key=lambda n: (work(n), n.node_id))
        self.last_switch, self.toward, self.since = now, None, None
        why = (
            f"prefill wants {desired['prefill']} nodes, has {len(prefill)}; "
            f"decode wants {desired['decode']}, has {len(decode)}"
        )
        return Switch(node.node_id, toward, why)
