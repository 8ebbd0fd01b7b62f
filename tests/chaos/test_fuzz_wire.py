"""Fuzzing the internal wire: well-framed nonsense. Every channel's decoder turns any msgpack
value, including ones tagged as a real message type with fields of the wrong kind or range,
into a message of that channel or None, never an exception (hypothesis). Then the same kind of
payloads, generated, go to a live cluster's sockets (the gateway's control and tokens
sockets, a decode node's data socket, its tcp KV port) with the frame counts each expects;
every process stays up and 40 streams afterwards return exact text with no block leaked."""

from __future__ import annotations

import random
import socket
import time
import typing

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.kv.tcp import ID_BYTES, frame_head
from pdserve.common.wire.protocol import (
    Msg,
)
from pdserve.common.wire.transport import decode_or_none, free_port
from tests.component.test_wire import CHANNELS
from tests.e2e.conftest import wait_for
from tests.e2e.streams import run_streams
from tests.e2e.test_faults import _bodies, _check_texts, _tokens_port

TYPES = [cls.__name__ for cls in Msg.__subclasses__()]
FIELDS = sorted({f for cls in Msg.__subclasses__() for f in cls.__struct_fields__})

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # msgpack's range
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
values = st.recursive(
    leaves,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def tagged(draw: st.DrawFn) -> bytes:
    """A msgpack map tagged as a real message type, with real field names and any values."""
    body = draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
    body["type"] = draw(st.sampled_from(TYPES) | st.text(max_size=10))
    return msgspec.msgpack.encode(body)


payloads = tagged() | values.map(msgspec.msgpack.encode) | st.binary(max_size=200)


@settings(max_examples=1500, deadline=None, database=None)
@given(data=payloads)
def test_every_decoder_answers_nonsense_with_none_or_a_message_of_its_channel(data: bytes):
    for decoder, union in CHANNELS:
        got = decode_or_none(decoder, data)
        assert got is None or isinstance(got, typing.get_args(union)), (got, union)


def test_generated_nonsense_on_every_live_socket_changes_nothing(
    make_cluster, tokenizer, chaos_scale
):
    data_port, kv_port = free_port(), free_port()
    cluster = make_cluster(
        engine="sim",
        node_flags=("--sim-time-scale", "0.05", "--kv-backend", "tcp"),
        extra={"decode-0": ("--data-port", str(data_port), "--kv-tcp-port", str(kv_port))},
    )
    tokens = cluster.control.rsplit(":", 1)[0] + ":" + str(_tokens_port(cluster))
    sent = {"control": 0, "tokens": 0, "data": 0, "tcp": 0}
    ctx = zmq.Context()
    socks = {
        "control": (ctx.socket(zmq.DEALER), cluster.control),
        "tokens": (ctx.socket(zmq.PUSH), tokens),
        "data": (ctx.socket(zmq.DEALER), f"tcp://127.0.0.1:{data_port}"),
    }
    for sock, address in socks.values():
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
    rng = random.Random(5)

    @settings(
        max_examples=400 * chaos_scale,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=payloads, where=st.sampled_from(sorted(sent)), extra=st.integers(0, 2))
    def one(data: bytes, where: str, extra: int) -> None:
        sent[where] += 1
        if where == "tcp":  # a greeting, then a frame head promising this payload
            with socket.create_connection(("127.0.0.1", kv_port), timeout=5) as s:
                rid = rng.choice(["nobody.0", "x" * 40, ""])
                s.sendall(b"fuzz".ljust(ID_BYTES) + frame_head(rid, 0, len(data)) + data)
            return
        sock, _ = socks[where]
        sock.send_multipart([data, *[rng.randbytes(8) for _ in range(extra)]])

    try:
        one()
        time.sleep(1.0)  # past several heartbeats: a dead loop shows by now
    finally:
        ctx.destroy(linger=0)
    print(f"\nwire fuzz: {sent}")
    assert all(n > 0 for n in sent.values())
    assert all(p.poll() is None for p in cluster.procs), "a process died"
    assert cluster.get("/health")[0] == 200
    bodies = _bodies(40, 8)
    _check_texts(tokenizer, bodies, run_streams(cluster.url, bodies, timeout=30))
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, timeout=8)
