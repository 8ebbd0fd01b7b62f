"""The messages between a prefill (or any KV-sending) node and a decode node: the KV
transfer's control channel (common/kv), and prefix fetches between nodes. The channels and
the rest of the messages are in protocol.py."""

from __future__ import annotations

import msgspec

from pdserve.common.node_id import WireNodeId
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Abort, DecodeTarget, Msg


# -- prefill <-> decode -------------------------------------------------------------------
class KvHeader(Msg):
    """Sent before prefill starts, so the decode node reserves blocks while layers compute."""

    request_id: str
    prompt_ids: list[int]  # every token whose KV follows (prompt, + generated if re-placed)
    num_prompt_tokens: int  # of those, the original prompt (for usage and max_tokens)
    params: SamplingParams
    num_layers: int
    frame_bytes: int  # bytes of each layer's frame
    prefill_node: WireNodeId
    backend: str = "zmq"  # the connector carrying the frames (common/kv)
    location: str = ""  # connector-specific (shm: the segment with layer i at i * frame_bytes)
    # whole blocks of the prompt whose KV the decode node holds already (its prefix cache):
    # the frames carry tokens skip_tokens.. only
    skip_tokens: int = 0
    fetch: bool = False  # prefix blocks a node fetched (KvFetch), not a request to decode
    gateway: str = ""  # the gateway that placed the request (RegisterAck.gateway_id)
    prompt_len: int = 0  # as in PrefillOffer: the client's prompt (0: num_prompt_tokens)
    stream_format: bytes = b""  # as in PrefillOffer: kept for a gateway that adopts it


class KvLayer(Msg):
    """Layer `layer` of the request's KV is ready: for the zmq backend its frame follows in
    the same message (one or more parts whose concatenation is the frame); shm and ucx carry
    the bytes elsewhere; tcp sends no descriptors (its stream frames describe themselves)."""

    request_id: str
    layer: int


class KvDone(Msg):
    """After the last layer: the first token, which the decode node continues from."""

    request_id: str
    first_token_id: int


class KvAck(Msg):
    request_id: str  # every layer is in the decode node's cache


class KvGrant(Msg):
    """shm_direct: write the frames straight into these blocks of the receiver's shared
    cache (the frame's tokens, after any it holds), each layer under the ticket's lock and
    only while the ticket still holds `nonce` (common/kv/grants.py)."""

    request_id: str
    ticket: int
    nonce: int
    block_table: list[int]


class KvFetch(Msg):
    """To a node whose cache holds a prefix: send the KV of `prompt_ids` (whole blocks) from
    token `skip_tokens` on (the asker holds the rest) to `reply_to`, as a transfer with
    `KvHeader.fetch` set and `KvDone.first_token_id` -1. Answered by that transfer, or by a
    `KvRefuse` when the blocks are gone."""

    request_id: str  # the fetch's own id
    prompt_ids: list[int]
    skip_tokens: int
    reply_to: DecodeTarget


PREFIX_GONE = "prefix no longer cached"  # a KvRefuse reason: send the whole prompt's KV


class KvRefuse(Msg):
    request_id: str
    reason: str


PrefillToDecode = KvHeader | KvLayer | KvDone | Abort | KvFetch
DecodeToPrefill = KvAck | KvRefuse | KvGrant


TO_DECODE_DECODER = msgspec.msgpack.Decoder(PrefillToDecode)
TO_PREFILL_DECODER = msgspec.msgpack.Decoder(DecodeToPrefill)
