"""The gateway's view of the cluster: registered nodes, their load, liveness. Pure.

Nodes register themselves; the first one fixes the cluster's model, dtype, tokenizer and KV
layout, and later ones must match (KV frames and token ids cross between them). A node is
dead after `heartbeat_timeout` seconds of silence. `now` is always passed in.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from pdserve.common.numerics import path_difference
from pdserve.common.wire.protocol import DecodeTarget, Foreign, Load, NodeInfo, Probe

EMPTY_LOAD = Load(running=0, waiting=0, blocks_free=0, blocks_cached=0, blocks_in_use=0)

# token ids the detokenizer takes (u32: past it, it raised for good); not the tokenizer's
# vocabulary: a model may pad its own past it, and sample an id there
TOKEN_ID_LIMIT = 1 << 32


@dataclass
class NodeState:
    """A registered node: what it said of itself, its last load report, and statistics. Where
    requests run is not here but in the request table (gateway/table.py)."""

    info: NodeInfo
    identity: bytes  # its control socket's ZeroMQ identity (node id + a per-process suffix)
    last_seen: float
    beat_gap: float = 0.0  # its heartbeats' gap, peaks kept; 0: none yet (gateway/succession.py)
    load: Load = EMPTY_LOAD
    load_at: float = 0.0  # when `load` was reported
    held: Container[str] = frozenset()  # `load.held`, for lookups
    refused_at: float = -1.0  # when it last refused KV: its report is stale until a newer one
    progress_at: float = 0.0  # when it last produced a token (the progress lease)
    # what it holds for other gateways (several gateways): from its load reports and answers
    foreign: Foreign = field(default_factory=Foreign)
    leader: str = ""  # the gateway it takes pool care from (Heartbeat.leader)
    accepts: int = 0  # offers accepted so far
    accepted_turn: int = 0  # `ClusterView.accepted`'s count at its last acceptance (0: none)
    rejects: int = 0

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def target(self) -> DecodeTarget:
        return DecodeTarget(
            node_id=self.info.node_id,
            data_address=self.info.data_address,
            host_id=self.info.host_id,
            kv_endpoints=self.info.kv_endpoints,
        )


@dataclass
class PrefixTotals:
    """The whole cluster's prefix-cache counters (tokens), kept as counters: each load report
    adds what its node's counts grew by since its last one, so a node leaving, restarting or
    switching role never takes the sum down (Prometheus reads any fall as a reset and adds
    the whole rest to `increase()`)."""

    queries: int = 0
    hits: int = 0
    fetched: int = 0
    # last counts per node process (control identity): kept after the node is dropped, so a
    # node re-registering from the same process does not count its history twice
    last: dict[bytes, tuple[int, int, int]] = field(default_factory=dict)

    def report(self, identity: bytes, load: Load) -> None:
        now = (load.prefix_queries, load.prefix_hits, load.prefix_fetched)
        before = self.last.pop(identity, (0, 0, 0))
        # a count below the last one started again (a role switch rebuilds the engine)
        grew = [n - b if n >= b else n for n, b in zip(now, before, strict=True)]
        self.queries += grew[0]
        self.hits += grew[1]
        self.fetched += grew[2]
        self.last[identity] = now  # re-inserted: the oldest process is first
        if len(self.last) > MAX_PROCESSES:
            del self.last[next(iter(self.last))]


MAX_PROCESSES = 4096  # node processes PrefixTotals remembers (pod churn must not grow it)


class ClusterView:
    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes: dict[str, NodeState] = {}
        self.reference: NodeInfo | None = None  # the first node fixes model/dtype/layout
        self.stalled_s = 0.0  # stalls excused so far (past a tick): detection is that late
        self.prefix_totals = PrefixTotals()
        self.acceptances = 0  # offers any node accepted: `NodeState.accepted_turn`'s clock

    def register(
        self, info: NodeInfo, identity: bytes, now: float, gateway_tokenizer: str
    ) -> str | None:
        """Adds the node; returns a refusal reason instead when it cannot join."""
        existing = self.nodes.get(info.node_id)
        if existing is not None:
            # the same node registering again (it lost our replies)
            if existing.info == info and existing.identity == identity:
                existing.last_seen = now
                return None
            return (
                f"node id {info.node_id!r} is already registered; give each node a unique --node-id"
            )
        reason = self.refusal(info, gateway_tokenizer)
        if reason is not None:
            return reason
        if self.reference is None:
            self.reference = info
        self.nodes[info.node_id] = NodeState(
            info=info, identity=identity, last_seen=now, progress_at=now
        )
        return None

    def refusal(
        self, node: NodeInfo | Probe, gateway_tokenizer: str, probed_at: float | None = None
    ) -> str | None:
        """Why a node of this model, numerics and KV layout cannot join (None: it can); asked
        at `Register`, and by a `Probe` (at `probed_at`) before the node loads its weights.
        A probe is not held to what a leaving cluster runs (every node draining, or silent
        for half its lease: a cluster being replaced by one of another model, as a compose
        or Kubernetes rollout does it); its `Register`, after the load, is."""
        if node.tokenizer_fingerprint != gateway_tokenizer:
            return (
                f"node {node.node_id} tokenizes differently from the gateway "
                "(start both with the same --model)"
            )
        ref = self.reference
        if ref is None or (probed_at is not None and self.leaving(probed_at)):
            return None  # the first node sets what the cluster runs
        for name in ("model_id", "dtype", "kv_layout"):
            mine, theirs = getattr(node, name), getattr(ref, name)
            if mine != theirs:
                return (
                    f"node {node.node_id} has {name} {mine!r} but the cluster runs "
                    f"{theirs!r} (set by {ref.node_id})"
                )
        return self._path_refusal(node, ref)

    def _path_refusal(self, node: NodeInfo | Probe, ref: NodeInfo) -> str | None:
        """Why a node whose numbers come from another code path (C kernels or eager ops, the
        GGUF kernel's, the CPU level) cannot join: its tokens would differ from the others'
        in the last bits. Held to the first node that said its path (an older node or a sim
        engine says none); a Probe says what it knows before the load, the CPU level."""
        mine = node.code_path
        said = (ref, *(n.info for n in self.nodes.values()))
        by = next((info for info in said if info.code_path), None)
        if not mine or by is None or (differ := path_difference(mine, by.code_path)) is None:
            return None
        return (
            f"node {node.node_id} computes {node.dtype} on another code path than the "
            f"cluster ({by.node_id}): {differ}; its tokens would differ in the last bits "
            "(give it the same C compiler, --cpu-kernels and PDSERVE_CPU_ISA)"
        )

    def leaving(self, now: float) -> bool:
        half = self.heartbeat_timeout / 2
        return all(n.load.draining or now - n.last_seen > half for n in self.nodes.values())

    def heartbeat(
        self, node_id: str, identity: bytes, load: Load, now: float, leader: str = ""
    ) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.identity != identity:
            return False
        node.beat_gap = max(now - node.last_seen, 0.75 * node.beat_gap)
        node.last_seen, node.load, node.load_at = now, load, now
        node.held = frozenset(load.held)
        self.prefix_totals.report(identity, load)
        node.foreign, node.leader = load.foreign, leader
        return True

    def fresh_view(self, awake: float, now: float) -> bool:
        """Every node's last report read since `awake` and within its own beat: three of its
        observed gaps (a node's jitter is no staleness), at least half the heartbeat timeout,
        at most the whole (past it the node is dropped anyway)."""
        half, whole = self.heartbeat_timeout / 2, self.heartbeat_timeout
        return all(
            n.load_at > awake and now - n.load_at <= min(whole, max(half, 3 * n.beat_gap))
            for n in self.nodes.values()
        )

    def accepted(self, node: NodeState) -> None:
        """`node` accepted an offer: it goes last among nodes otherwise equal (on-demand)."""
        self.acceptances += 1
        node.accepts += 1
        node.accepted_turn = self.acceptances

    def leads(self, gateway_id: str) -> bool:
        """Pool care is this gateway's to decide: no node takes it from another gateway
        (each names the lowest-id gateway it is registered with; docs/architecture.md,
        "Several gateways")."""
        # none: nothing to care for (a gateway cut off from every node exported its own
        # desired replicas beside the leader's)
        return bool(self.nodes) and all(n.leader in ("", gateway_id) for n in self.nodes.values())

    def holds(self, node: NodeState) -> bool:
        """`node` is still the registered process of its id (not dropped, not restarted)."""
        return self.nodes.get(node.node_id) is node

    def by_identity(self, identity: bytes) -> NodeState | None:
        return next((n for n in self.nodes.values() if n.identity == identity), None)

    def remove(self, node_id: str) -> NodeState | None:
        node = self.nodes.pop(node_id, None)
        if not self.nodes:
            self.reference = None  # an empty cluster may be re-formed with another model
        return node

    def excuse(self, seconds: float) -> None:
        """Moves every lease on by `seconds` the gateway itself could not run."""
        self.stalled_s += seconds
        for n in self.nodes.values():
            n.last_seen += seconds
            n.progress_at += seconds

    def expired(self, now: float) -> list[str]:
        return [
            n.node_id for n in self.nodes.values() if now - n.last_seen > self.heartbeat_timeout
        ]

    def alive(self, role: str) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.info.role == role and not n.load.draining]

    @property
    def max_model_len(self) -> int:
        lens = [n.info.max_model_len for n in self.nodes.values()]
        return min(lens) if lens else 0

    def vocab_size(self, tokenizer_vocab: int) -> int:
        """Token ids below this every node takes: the smallest model vocabulary its nodes
        said (a node refuses ids past its own, which may be smaller than the tokenizer's, or
        padded past it); the tokenizer's, `tokenizer_vocab`, while none said (older nodes)."""
        said = [n.info.vocab_size for n in self.nodes.values() if n.info.vocab_size > 0]
        # a node's word bounded by what the gateway's prefix hashes take (a signed 64-bit id)
        return min(min(said), TOKEN_ID_LIMIT) if said else tokenizer_vocab

    def health(self) -> str | None:
        """None when serving is possible, else why not."""
        if self.alive("colocated"):
            return None  # one engine doing both phases serves alone
        missing = [r for r in ("prefill", "decode") if not self.alive(r)]
        if missing:
            return "no live " + " or ".join(missing) + " node registered"
        return None
