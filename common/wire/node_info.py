"""What a node says of itself when it registers (`Register.info`): the gateway's view of it
(gateway/cluster.py), and what a cluster's nodes must agree on. The messages are in
protocol.py, which re-exports these."""

from __future__ import annotations

from typing import Literal

import msgspec

from pdserve.common.node_id import WireNodeId

Role = Literal["prefill", "decode", "colocated"]


class NodeInfo(msgspec.Struct, kw_only=True, frozen=True):
    node_id: WireNodeId
    role: Role
    data_address: str  # where peers reach this node's data socket ("" if none)
    host_id: str  # same value = same host / IPC namespace (for the shared-memory path)
    model_id: str
    dtype: str
    tokenizer_fingerprint: str
    kv_layout: str  # ModelConfig.layout_fingerprint()
    block_size: int
    num_blocks: int
    max_batch: int
    max_batch_tokens: int
    max_model_len: int
    # decode: where each KV backend it offers reaches it (common/kv): "zmq" its data
    # socket, "tcp" HOST:PORT of its stream listener, "shm" its host identity, "ucx" HOST:PORT
    kv_endpoints: dict[str, str] = msgspec.field(default_factory=dict)
    # what it understands beyond the base protocol (NODE_FEATURES): asked only what it reads
    features: tuple[str, ...] = ()
    code_path: str = ""  # what computes `dtype`'s numbers (common/numerics.py); "": unsaid
    # its model's vocabulary: it refuses prompt ids from here on, which the gateway refuses
    # first (a model's may be smaller than its tokenizer's, or padded past it); 0: unsaid
    vocab_size: int = 0


# `Release.tokens`: the node ends a stream at that many output tokens and keeps them
RELEASE_TOKENS = "release-tokens"
NODE_FEATURES = (RELEASE_TOKENS,)
