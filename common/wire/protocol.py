"""Every message on pdserve's internal sockets, as tagged msgspec Structs (the flow they make
is in docs/architecture.md).

Each channel decodes into one tagged union with a typed decoder, so a peer that sends anything else
gets a `msgspec.ValidationError`, never a surprise object. KV bytes never travel inside msgpack:
they go as raw frames beside it, where the KV connector puts them (`KvLayer` says where, common/kv).

Channels:
    node -> gateway     (DEALER -> ROUTER)  NodeToGateway  (Register's NodeInfo: node_info.py)
    gateway -> node     (ROUTER -> DEALER)  GatewayToNode
    prefill -> decode   (DEALER -> ROUTER)  PrefillToDecode  (+ raw KV frames: kv_messages.py)
    decode -> prefill   (ROUTER -> DEALER)  DecodeToPrefill  (kv_messages.py)
    node -> node        the same two, for prefix blocks one node fetches from another
                        (KvFetch to the holder's data socket; the holder sends KV back)
    decode -> gateway   (PUSH -> PULL)      DecodeToGateway
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdserve.common.node_id import WireNodeId
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.node_info import (  # noqa: F401 (re-exported: what Register says)
    NODE_FEATURES,
    RELEASE_TOKENS,
    NodeInfo,
)


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base: the class name is the tag."""


# -- node -> gateway ----------------------------------------------------------------------
class Foreign(msgspec.Struct, kw_only=True, frozen=True):
    """What a node holds for the other gateways it serves (several gateways, one cluster):
    each gateway derives a node's in-flight work from its own request table and adds this."""

    prefill: tuple[int, ...] = ()  # prompt lengths of requests not prefilled yet
    decoding: int = 0  # requests past prefill, or whose KV is arriving


class GatewayLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A gateway's arrivals since it started and the prompt tokens waiting there, for the
    gateway sizing the pools for every gateway (gateway/others.py). Nodes relay it."""

    gateway: str
    seq: int = 0  # counts the gateway's reports: a node relaying older news is told apart
    prompt_tokens: int = 0
    requests: int = 0
    output_tokens: int = 0  # asked for
    local_tokens: int = 0  # of prompt_tokens, prefilled by their decode nodes (not the pool's)
    waiting_tokens: int = 0


class Load(msgspec.Struct, kw_only=True, frozen=True):
    running: int  # sequences in the engine (prefill batch or decode batch)
    waiting: int  # queued locally (queueing mode) or KV transfers in progress
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    held: tuple[str, ...] = ()  # request ids it holds for the gateway it reports to (the lease)
    foreign: Foreign = Foreign()  # what it holds for other gateways
    draining: bool = False
    prefix_queries: int = 0  # prompt tokens looked up in its prefix cache, since it started
    prefix_hits: int = 0  # of those, found cached
    prefix_fetched: int = 0  # of those hits, tokens whose KV was fetched from another node
    token_cost: float = 0.0  # measured prefill seconds per token (0: none measured yet)
    gateways: tuple[GatewayLoad, ...] = ()  # the other gateways' loads, as they last said


class Register(Msg):
    info: NodeInfo
    # seconds since this role's first RegisterAck from any gateway (0: none yet), so a repeat
    # (after a drop, or to a restarted gateway) keeps its switch dwell (gateway/roles.py)
    served_s: float = 0.0


class Probe(Msg):
    """Would the cluster take a node of these? Asked before the weights load (precheck.py)."""

    node_id: WireNodeId
    model_id: str
    dtype: str
    tokenizer_fingerprint: str
    kv_layout: str
    code_path: str = ""  # its part known before the load (the CPU level); "": unsaid


class KvEvents(Msg):
    """Prefix blocks (chained hashes, common/engine/block_manager.py) the node's cache stored
    or evicted since its previous KvEvents; `seq` counts the node's messages from 0, so a
    gap tells the gateway one was lost (it asks for a snapshot). With `snapshot`, `stored`
    is everything the node holds and replaces what the gateway knew of it."""

    node_id: WireNodeId
    seq: int
    stored: list[bytes] = msgspec.field(default_factory=list)
    evicted: list[bytes] = msgspec.field(default_factory=list)
    snapshot: bool = False


class Heartbeat(Msg):
    node_id: WireNodeId
    load: Load
    kv_seq: int = -1  # the last KvEvents sent (-1: none): the gateway sees a lost last one
    # the gateway this node takes pool care from (the lowest id among those it is registered
    # with: docs/architecture.md, "Several gateways"); "" before it knows any id
    leader: str = ""
    # the prefix cache's changes since the last heartbeat (a KvEvents: kv_seq counts it too)
    events: KvEvents | None = None
    # the node wants a HeartbeatReply even with nothing in it (after a silence of this gateway:
    # its liveness check needs one); else the gateway answers only stale ids, resync, unknown
    reply: bool = True


class Accept(Msg):
    request_id: str
    foreign: Foreign | None = None  # as in Load, now (several gateways)


class Reject(Msg):
    request_id: str
    reason: str
    room: int = -1  # the longest prompt (tokens) it would accept now; -1: not known
    foreign: Foreign | None = None  # as in Load, now (several gateways)


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
    refused_by: WireNodeId
    reason: str


class Migrate(Msg):
    """A draining decode node asks where a running sequence's KV should go. The gateway
    answers `Redirect` (another decode node, or None: re-placed by recompute); the node then
    sends the KV as a prefill node would (KvHeader, frames, KvDone with the newest token) and
    the sequence decodes on there under the same wire id, its output indices continuing."""

    request_id: str
    reason: str


class PrefillFailed(Msg):
    request_id: str
    reason: str


class Deregister(Msg):
    node_id: WireNodeId


class KvTransferred(Msg):
    """A prefill node's record of one finished KV handoff, for the request's timeline. Times
    in ms since the node accepted the request: from the first KV byte sent to KvAck, and how
    much of that ran while the prefill pass was still computing (layer-wise sending)."""

    request_id: str
    backend: str
    bytes: int
    layerwise: bool
    start_ms: float  # the first layer's frame went out
    end_ms: float  # KvAck received
    overlap_ms: float = 0.0  # of start..end, the part before the forward pass ended


class Adopted(Msg):
    """A node's answer to `Adopt`: the request's state, now the asking gateway's (`found`), or
    why not. `prompt_ids` is the client's prompt; `output_ids` every token generated for it so
    far, `base` of them by earlier attempts (the wire id's attempt counts from there); `params`
    are the attempt's (max_tokens: what it has left); `finish_reason` is set when it ended (its
    tokens all here), "preempted" if its node gave it back; `stream_format` its PrefillOffer's."""

    request_id: str  # the wire id (request_id.attempt); Adopt's request id when not found
    found: bool
    reason: str = ""
    prompt_ids: list[int] = msgspec.field(default_factory=list)
    output_ids: list[int] = msgspec.field(default_factory=list)
    base: int = 0
    params: SamplingParams | None = None
    finish_reason: str | None = None
    stream_format: bytes = b""


# an `Adopted` refusal: the asking gateway is silent to the node or registering (adopted
# now, the stream would stay an orphan, for a third gateway to adopt too): ask again
REGISTERING = "the gateway is registering with this node"
# `Preempted` / `PrefillFailed` reason: freed or given back in its gateway's silence, told
FREED = "given back while its gateway was silent"  # when it answers: no node's fault


class Wanted(Msg):
    """To the gateway serving `request_id` (the wire id): a client resumes it at another
    gateway, so it has lost this gateway's connection (one half-open: no FIN came). A
    resumable stream's gateway hangs that connection up and lets the stream go (`Release`)
    for the resume (docs/architecture.md, "Several gateways"). `taken`: another gateway
    adopted it already, while this one was silent to the node: nothing here is to be let go,
    the request is forgotten and its connection hung up."""

    request_id: str
    taken: bool = False


NodeToGateway = (Adopted | Wanted | KvTransferred | KvEvents | Register | Probe | Heartbeat
                 | Accept | Reject | FirstToken | NeedDecode | Migrate | PrefillFailed
                 | Deregister)  # fmt: skip


# -- gateway -> node ----------------------------------------------------------------------
class RegisterAck(Msg):
    node_id: WireNodeId
    tokens_address: str  # where decode nodes push TokenBatch messages
    # prefill nodes: accept every offer and queue locally (the baseline policies), or answer
    # by batch room (on-demand); the gateway's policy decides, for every node alike
    queueing: bool = False
    # this gateway process (random at start): a decode node sends a request's tokens to the
    # gateway the prefill node names in `KvHeader.gateway` (several gateways, one cluster)
    gateway_id: str = ""


class RegisterRefuse(Msg):
    node_id: WireNodeId
    reason: str


class Fits(Msg):  # the answer to a `Probe` the cluster would take
    node_id: WireNodeId


class HeartbeatReply(Msg):
    stale: tuple[str, ...] = ()  # request ids the gateway no longer knows: free them
    unknown_node: bool = False  # the gateway restarted or dropped us: register again
    kv_resync: bool = False  # a KvEvents was lost: send a snapshot of the prefix cache
    load: GatewayLoad | None = None  # the gateway's own (relayed to the other gateways)


class DecodeTarget(msgspec.Struct, kw_only=True, frozen=True):
    node_id: WireNodeId
    data_address: str  # the ZeroMQ data socket: headers, descriptors, acks
    host_id: str
    kv_endpoints: dict[str, str] = msgspec.field(default_factory=dict)  # as in NodeInfo


class PrefillOffer(Msg):
    request_id: str
    prompt_ids: list[int]  # prompt, or prompt + generated tokens when re-placed
    params: SamplingParams
    decode: DecodeTarget
    # tokens of the prompt whose KV the decode node already holds (a conversation's earlier
    # turns, by the gateway's prefix index): only the rest is sent
    decode_cached: int = 0
    # a node whose cache holds `fetch_tokens` leading tokens of the prompt, more than this
    # node does (the index): the prefill node may fetch those blocks rather than compute them
    fetch_from: DecodeTarget | None = None
    fetch_tokens: int = 0
    # how long the request has waited at its gateway: a node serving several gateways gives
    # freed room to the one waiting longest (common/node/fairness.py)
    waited_ms: float = 0.0
    # tokens of `prompt_ids` that are the client's prompt (0: all; the rest: earlier attempts'
    # output), and how the gateway writes the stream (not read here): kept for an adopter
    prompt_len: int = 0
    stream_format: bytes = b""
    # several gateways: the prompt tokens the gateway believes the node has yet to prefill
    # for the other gateways (its last report of them); a node that has more rejects the
    # offer as placed on a stale view, with what it has now (-1: no belief, never rejected)
    foreign_prefill: int = -1


class Adopt(Msg):
    """Clients resume streams whose gateway is gone or let them go (docs/architecture.md,
    "Several gateways"): for each (request id without the attempt, `have`) in `streams`,
    the node holding it as an orphan hands it to this gateway (`Adopted`) if the client's
    `have` output tokens are no more than it made. One message per node per round carries
    every stream the gateway looks for then, however many clients resume at once."""

    streams: list[tuple[str, int]]


class Release(Msg):
    """The gateway lets go of a resumable stream whose client left, or that ended
    (docs/architecture.md, "Several gateways"): the node keeps it as an orphan, decoding
    on, for any gateway to adopt (`Adopt`) within `--orphan-grace`, this one included.
    `tokens` >= 0: it ended at the gateway after that many output tokens (a stop string):
    the node ends it there too and keeps those."""

    request_id: str
    tokens: int = -1


class Redirect(Msg):
    request_id: str
    decode: DecodeTarget | None  # None: no decode node can take it, give up


class Abort(Msg):
    request_id: str


class Drain(Msg): ...


class Rebalance(Msg):
    """To a decode node that is filling up while another has room: move these running
    sequences (wire ids) with their KV, as a drain would (`Migrate` for each), and go on
    serving (gateway/rebalance.py)."""

    request_ids: tuple[str, ...]


class SwitchRole(Msg):
    """Take the other role: stop taking work, finish or move what is held (a drain), leave,
    and register again as `role` in the same process, weights and KV cache kept
    (gateway/roles.py decides; common/node/roles.py does it)."""

    role: Literal["prefill", "decode"]


GatewayToNode = (Adopt | RegisterAck | RegisterRefuse | Fits | HeartbeatReply | PrefillOffer
                 | Redirect | Release | Abort | Drain | Rebalance | SwitchRole)  # fmt: skip


# -- decode -> gateway --------------------------------------------------------------------
class TokenBatch(Msg):
    """One engine step: the new token of every sequence that produced one.

    `indices[i]` is the position of `token_ids[i]` among its attempt's output tokens (0 is
    the first token, sent by the prefill node as `FirstToken` on another socket). The gateway
    places tokens by index, so the order in which the two sockets are read never matters.
    The four lists have one entry per sequence; a batch whose lists differ is malformed."""

    node_id: WireNodeId
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

    node_id: WireNodeId
    request_id: str
    reason: str


DecodeToGateway = TokenBatch | Preempted

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


NODE_DECODER = msgspec.msgpack.Decoder(NodeToGateway)
GATEWAY_DECODER = msgspec.msgpack.Decoder(GatewayToNode)
TOKENS_DECODER = msgspec.msgpack.Decoder(DecodeToGateway)
