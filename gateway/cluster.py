"""The gateway's view of the cluster: registered nodes, their load, liveness. Pure.

Nodes register themselves; the first one fixes the cluster's model, dtype, tokenizer and KV
layout, and later ones must match (KV frames and token ids cross between them). A node is
dead after `heartbeat_timeout` seconds of silence. `now` is always passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.protocol import DecodeTarget, Load, NodeInfo

EMPTY_LOAD = Load(running=0, waiting=0, blocks_free=0, blocks_cached=0, blocks_in_use=0)


@dataclass
class NodeState:
    info: NodeInfo
    identity: bytes  # its control socket's ZeroMQ identity (node id + a per-process suffix)
    last_seen: float
    load: Load = EMPTY_LOAD
    # requests offered and accepted here, not yet prefilled: wire id -> prompt tokens
    in_prefill: dict[str, int] = field(default_factory=dict)
    decoding: set[str] = field(default_factory=set)  # request ids whose KV is headed here
    reserved_blocks: int = 0  # our estimate of blocks promised since the last load report
    accepts: int = 0
    rejects: int = 0
    assigned: int = 0  # decode: requests whose KV was sent here

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def free_blocks(self) -> int:
        return self.load.blocks_free + self.load.blocks_cached - self.reserved_blocks

    def target(self) -> DecodeTarget:
        return DecodeTarget(
            node_id=self.info.node_id,
            data_address=self.info.data_address,
            host_id=self.info.host_id,
            ucx_address=self.info.ucx_address,
            tcp_address=self.info.tcp_address,
        )


class ClusterView:
    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.nodes: dict[str, NodeState] = {}
        self.reference: NodeInfo | None = None  # the first node fixes model/dtype/layout

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
        if info.tokenizer_fingerprint != gateway_tokenizer:
            return (
                f"node {info.node_id} tokenizes differently from the gateway "
                "(start both with the same --model)"
            )
        ref = self.reference
        if ref is not None:
            for name in ("model_id", "dtype", "kv_layout"):
                mine, theirs = getattr(info, name), getattr(ref, name)
                if mine != theirs:
                    return (
                        f"node {info.node_id} has {name} {mine!r} but the cluster runs "
                        f"{theirs!r} (set by {ref.node_id})"
                    )
        else:
            self.reference = info
        self.nodes[info.node_id] = NodeState(info=info, identity=identity, last_seen=now)
        return None

    def heartbeat(self, node_id: str, identity: bytes, load: Load, now: float) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.identity != identity:
            return False
        node.last_seen, node.load, node.reserved_blocks = now, load, 0
        return True

    def by_identity(self, identity: bytes) -> NodeState | None:
        return next((n for n in self.nodes.values() if n.identity == identity), None)

    def remove(self, node_id: str) -> NodeState | None:
        node = self.nodes.pop(node_id, None)
        if not self.nodes:
            self.reference = None  # an empty cluster may be re-formed with another model
        return node

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

    def health(self) -> str | None:
        """None when serving is possible, else why not."""
        if self.alive("colocated"):
            return None  # one engine doing both phases serves alone
        missing = [r for r in ("prefill", "decode") if not self.alive(r)]
        if missing:
            return "no live " + " or ".join(missing) + " node registered"
        return None
