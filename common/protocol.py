"""Every message on pdserve's internal sockets (DESIGN §4), as tagged msgspec Structs.

Each channel decodes into one tagged union with a typed decoder, so a peer that sends
anything else gets a `msgspec.ValidationError`, never a surprise object. KV bytes never
travel inside msgpack: a `KvLayer` struct is followed by one raw frame in the same
multipart message, sent with `copy=False`.

Channels:
    node -> gateway     (DEALER -> ROUTER)  NodeToGateway
    gateway -> node     (ROUTER -> DEALER)  GatewayToNode
    prefill -> decode   (DEALER -> ROUTER)  PrefillToDecode  (+ raw KV frames)
    decode -> prefill   (ROUTER -> DEALER)  DecodeToPrefill
    decode -> gateway   (PUSH -> PULL)      DecodeToGateway
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdserve.common.sampling import SamplingParams

Role = Literal["prefill", "decode", "colocated"]


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base: the class name is the tag."""


# -- node -> gateway ----------------------------------------------------------------------
class NodeInfo(msgspec.Struct, kw_only=True, frozen=True):
    node_id: str
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
    ucx_address: str = ""  # decode: HOST:PORT of its UCX listener, "" without UCX
    tcp_address: str = ""  # decode: HOST:PORT of its in-place TCP KV listener
    queueing: bool = False  # accepts every offer and queues locally (baseline schedulers)


class Load(msgspec.Struct, kw_only=True, frozen=True):
    running: int  # sequences in the engine (prefill batch or decode batch)
    waiting: int  # queued locally (queueing mode) or KV transfers in progress
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    held: tuple[str, ...] = ()  # request ids whose KV this node holds (the lease)
    draining: bool = False


class Register(Msg):
    info: NodeInfo


class Heartbeat(Msg):
    node_id: str
    load: Load


class Accept(Msg):
    request_id: str


class Reject(Msg):
    request_id: str
    reason: str


class FirstToken(Msg):
    """The attempt's first token (output index 0), sent the moment prefill samples it."""

    request_id: str
    token_id: int
    index: int = 0  # position among the attempt's output tokens (see TokenBatch)
    finish_reason: str | None = None  # set when the request ends at this token
    prefill_ms: float = 0.0
    queue_ms: float = 0.0


class NeedDecode(Msg):
    """The chosen decode node refused the KV: give me another one."""

    request_id: str
    refused_by: str
    reason: str


class PrefillFailed(Msg):
    request_id: str
    reason: str


class Deregister(Msg):
    node_id: str


class KvTransferred(Msg):
    """A prefill node's record of one finished KV handoff, for the request's timeline."""

    request_id: str
    backend: str
    bytes: int
    layerwise: bool
    start_ms: float  # since the node accepted the request
    end_ms: float  # KvAck received


NodeToGateway = (
    KvTransferred
    | Register
    | Heartbeat
    | Accept
    | Reject
    | FirstToken
    | NeedDecode
    | PrefillFailed
    | Deregister
)


# -- gateway -> node ----------------------------------------------------------------------
class RegisterAck(Msg):
    node_id: str
    tokens_address: str  # where decode nodes push TokenBatch messages


class RegisterRefuse(Msg):
    node_id: str
    reason: str


class HeartbeatReply(Msg):
    stale: tuple[str, ...] = ()  # request ids the gateway no longer knows: free them
    unknown_node: bool = False  # the gateway restarted or dropped us: register again


class DecodeTarget(msgspec.Struct, kw_only=True, frozen=True):
    node_id: str
    data_address: str
    host_id: str
    ucx_address: str = ""
    tcp_address: str = ""


class PrefillOffer(Msg):
    request_id: str
    prompt_ids: list[int]  # prompt, or prompt + generated tokens when re-placed
    params: SamplingParams
    decode: DecodeTarget
    num_generated: int = 0  # tokens already produced before a re-placement


class Redirect(Msg):
    request_id: str
    decode: DecodeTarget | None  # None: no decode node can take it, give up


class Abort(Msg):
    request_id: str


class Drain(Msg):
    pass


GatewayToNode = (
    RegisterAck | RegisterRefuse | HeartbeatReply | PrefillOffer | Redirect | Abort | Drain
)


# -- prefill <-> decode -------------------------------------------------------------------
class KvHeader(Msg):
    """Sent before prefill starts, so the decode node reserves blocks while layers compute."""

    request_id: str
    prompt_ids: list[int]  # every token whose KV follows (prompt, + generated if re-placed)
    num_prompt_tokens: int  # of those, the original prompt (for usage and max_tokens)
    params: SamplingParams
    num_layers: int
    frame_bytes: int  # bytes of each layer's frame
    prefill_node: str
    backend: str = "zmq"  # where the frames travel: zmq | shm | ucx (common/kv_transfer)
    shm_name: str = ""  # shm: the segment holding layer i at offset i * frame_bytes


class KvLayer(Msg):
    request_id: str
    layer: int  # zmq: followed by one raw frame of KvHeader.frame_bytes bytes


class KvDone(Msg):
    """After the last layer: the first token, which the decode node continues from."""

    request_id: str
    first_token_id: int


class KvAck(Msg):
    request_id: str  # every layer is in the decode node's cache


class KvRefuse(Msg):
    request_id: str
    reason: str


PrefillToDecode = KvHeader | KvLayer | KvDone | Abort
DecodeToPrefill = KvAck | KvRefuse


# -- decode -> gateway --------------------------------------------------------------------
class TokenBatch(Msg):
    """One engine step: the new token of every sequence that produced one.

    `indices[i]` is the position of `token_ids[i]` among its attempt's output tokens (0 is
    the first token, sent by the prefill node as `FirstToken` on another socket). The gateway
    places tokens by index, so the order in which the two sockets are read never matters.
    The four lists have one entry per sequence; a batch whose lists differ is malformed."""

    node_id: str
    request_ids: list[str]
    token_ids: list[int]
    indices: list[int]
    finish_reasons: list[str | None]

    def well_formed(self) -> bool:
        n = len(self.request_ids)
        return len(self.token_ids) == n and len(self.indices) == n and len(self.finish_reasons) == n


class Preempted(Msg):
    """The decode node ran out of KV blocks (or is draining) and dropped this request; the
    gateway re-places it as a prefill of prompt + generated tokens."""

    node_id: str
    request_id: str
    reason: str


DecodeToGateway = TokenBatch | Preempted

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


NODE_DECODER = msgspec.msgpack.Decoder(NodeToGateway)
GATEWAY_DECODER = msgspec.msgpack.Decoder(GatewayToNode)
TO_DECODE_DECODER = msgspec.msgpack.Decoder(PrefillToDecode)
TO_PREFILL_DECODER = msgspec.msgpack.Decoder(DecodeToPrefill)
TOKENS_DECODER = msgspec.msgpack.Decoder(DecodeToGateway)
