"""Every KV transfer backend moves a request's KV byte-exactly between two paged caches
(real sockets, shared memory or UCX), for sizes around block boundaries, and aborts free
the decode side's reservation."""

from __future__ import annotations

import asyncio
import hashlib
import socket

import pytest
import torch

from benchmarks.cache_engine import CacheOnlyEngine
from pdserve.common.kv import BACKENDS as REGISTERED
from pdserve.common.kv import backend, choose, listen_all, receivers_for
from pdserve.common.kv.base import Backend, Local, ReceiveConnector, SendConnector
from pdserve.common.kv.intake import Intake, KvIntake
from pdserve.common.kv.sender import KvSender, Transfer
from pdserve.common.kv.tcp import ID_BYTES, frame_head
from pdserve.common.kv.ucx import available as ucx_available
from pdserve.common.model.config import load_model_config, resolve_model
from pdserve.common.node import host_identity
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import (
    KvDone,
    KvHeader,
)
from pdserve.common.wire.protocol import (
    Abort,
    DecodeTarget,
    encode,
)
from pdserve.common.wire.security import ClusterKey, close_context, make_context
from pdserve.common.wire.transport import bound_address, make_socket
from tests.component.cluster import until

BLOCK = 16
LAYOUT = load_model_config(resolve_model(None))  # SmolLM2: 30 layers x 3 KV heads x 64


def digest(engine: CacheOnlyEngine, table: list[int], n: int) -> str:
    h = hashlib.sha256()
    for layer in range(LAYOUT.num_layers):
        h.update(engine.kv_store.export_frame(layer, table, n))
    return h.hexdigest()


class Pair:
    """A sender and an intake over real sockets in this process."""

    def __init__(self, backend: str, capacity: int, key: ClusterKey | None = None) -> None:
        self.ctx = make_context(key)
        self.backend = backend
        self.src = CacheOnlyEngine(LAYOUT, capacity, BLOCK, torch.float32)
        shared = backend == "shm_direct"  # its cache in /dev/shm, the writer's target
        self.dst = CacheOnlyEngine(LAYOUT, capacity, BLOCK, torch.float32, shared=shared)
        self.src.cache.data.normal_(generator=torch.Generator().manual_seed(0))
        self.free = list(range(self.dst.cache.num_blocks))[::-1]
        self.admitted: asyncio.Queue[Intake] = asyncio.Queue()
        self.acked: asyncio.Queue[Transfer] = asyncio.Queue()
        self.refusals: list[str] = []
        self.sock = make_socket(self.ctx, "node.data", "tcp://127.0.0.1:0", max_msg=1 << 30)
        address = bound_address(self.sock, "127.0.0.1")
        forced = backend if backend in REGISTERED else "auto"
        local = Local(
            "d",
            host_identity(),
            "127.0.0.1",
            self.dst.kv_store,
            address,
            5.0,
            forced=forced,
            key=key,
        )  # type: ignore[arg-type]
        self.receivers = receivers_for(local)
        self.intake = KvIntake(
            self.sock,
            self.dst.kv_store,
            self.reserve,
            self.release,
            self.admit,
            self.receivers,  # type: ignore[arg-type]
        )
        self.task = asyncio.create_task(self.intake.run())
        self.sender = KvSender(
            self.ctx,
            Local("p", host_identity(), "127.0.0.1", self.src.kv_store, forced=forced, key=key),  # type: ignore[arg-type]
            on_ack=self.acked.put_nowait,
            on_refuse=self.on_refuse,
        )

    async def start(self) -> Pair:
        endpoints = await listen_all(self.receivers, self.intake.landing)
        self.endpoints = endpoints
        self.target = DecodeTarget(
            node_id="d",
            data_address=endpoints["zmq"],
            host_id=host_identity(),
            kv_endpoints=endpoints,
        )
        return self

    @property
    def tcp_address(self) -> str:
        return self.endpoints["tcp"]

    def reserve(self, header):
        need = -(-(len(header.prompt_ids) + 1) // BLOCK)
        if need > len(self.free):
            return "no room"
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    async def admit(self, intake: Intake, first_token: int) -> None:
        self.admitted.put_nowait(intake)

    async def on_refuse(self, rid: str, peer: str, why: str) -> None:
        self.refusals.append(why)

    async def send(self, rid: str, n: int, table: list[int], layerwise: bool) -> Intake:
        t = self.sender.begin(rid, self.target, list(range(n)), n, SamplingParams(), table)
        if layerwise:
            for layer in range(LAYOUT.num_layers):
                self.sender.push(t, layer, self.sender.stage(t, layer))
        else:
            self.sender.push_all(t, self.sender.stage_all(t))
        self.sender.done(t, 1)
        acked = await asyncio.wait_for(self.acked.get(), 10)
        assert acked.request_id == rid and acked.backend == t.backend
        return await asyncio.wait_for(self.admitted.get(), 10)

    async def close(self) -> None:
        await self.sender.close()
        self.task.cancel()
        await self.intake.close()
        close_context(self.ctx)


BACKENDS = [
    "zmq",
    "shm",
    "shm_direct",
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            not ucx_available(), reason="ucxx is not installed (pip install '.[ucx]')"
        ),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_backends_move_kv_byte_exact_around_block_boundaries(backend):
    pair = await Pair(backend, capacity=600).start()
    try:
        for i, n in enumerate([1, 15, 16, 17, 33, 257] * 2):
            table = list(range(i, i + 40, 1))[: -(-n // BLOCK)]  # a different spot each time
            intake = await pair.send(f"r{i}", n, table, layerwise=i % 2 == 0)
            assert intake.header.backend == backend
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, table, n), n
            assert intake.bytes_in == LAYOUT.num_layers * pair.src.kv_store.frame_bytes(n)
            pair.release(intake.block_table)
        assert not pair.intake.incoming and not pair.sender.transfers
        if backend == "shm":  # segments are reused, not created per request
            pool = pair.sender.connector("shm").pool  # type: ignore[attr-defined]
            assert [seg.size for seg in pool.all] == [1 << 20, 2 << 20, 16 << 20]
    finally:
        await pair.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_fragmented_source_goes_through_the_staging_path_byte_exact(backend):
    """More runs of blocks than views are sent for: each layer is gathered and staged to
    the host (common/engine/staging.py, the path a GPU cache always takes) and the sender
    waits for the staged copy before it frames the layer."""
    pair = await Pair(backend, capacity=1200).start()
    try:
        n = 600
        table = list(range(74, -1, -2))  # 38 blocks, none adjacent: 38 runs a half
        for layerwise in (True, False):
            rid = f"frag-{layerwise}"
            intake = await pair.send(rid, n, table, layerwise=layerwise)
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, table, n)
            pair.release(intake.block_table)
    finally:
        await pair.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_refused_and_aborted_transfers_leave_nothing_behind(backend):
    pair = await Pair(backend, capacity=600).start()
    pair.free = pair.free[:8]  # the decode side has room for 8 blocks only
    total = len(pair.free)
    try:
        t = pair.sender.begin(
            "big", pair.target, list(range(500)), 500, SamplingParams(), list(range(32))
        )
        pair.sender.push_all(t, pair.sender.stage_all(t))  # refused at the header
        # waits on the state, not on time (a loaded host took over 1 s here)
        await until(lambda: bool(pair.refusals), 5.0, "the refusal")
        assert pair.refusals == ["no room"]
        pair.sender.release("big")
        t = pair.sender.begin("gone", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        for layer in range(10):
            pair.sender.push(t, layer, pair.sender.stage(t, layer))
        await until(lambda: len(pair.free) < total, 5.0, "blocks reserved while in flight")
        pair.sender.abort("gone")
        await until(lambda: len(pair.free) == total and not pair.intake.active, 5.0, "all freed")
        ok = await pair.send("after", 20, [5, 6], layerwise=True)  # the channel still works
        assert digest(pair.dst, ok.block_table, 20) == digest(pair.src, [5, 6], 20)
    finally:
        await pair.close()


def test_backend_choice_follows_where_the_peers_are():
    me = Local("p", "h1", "127.0.0.1", None)  # type: ignore[arg-type]
    senders = {name: backend(name).send(me) for name in REGISTERED}

    def pick(forced: str, **endpoints: str) -> str:
        return choose(
            forced, lambda b, ep: senders[b].usable(ep), {"zmq": "tcp://x:1", **endpoints}
        )

    assert pick("auto", shm="h1", tcp="x:2") == "shm"
    assert pick("auto", shm="h2", tcp="x:2") == "tcp"  # another host: no shared memory
    assert pick("auto", shm="h2", ucx="x:3") == "zmq"  # no TCP listener; ucx only on request
    assert pick("shm", shm="h2") == "zmq"  # cannot share memory across hosts
    assert pick("ucx", shm="h1") == "zmq"  # the peer has no UCX listener
    assert pick("ucx", ucx="x:1") == "ucx"
    assert pick("tcp", shm="h1") == "zmq"  # the peer has no TCP listener
    assert pick("tcp", tcp="x:2") == "tcp"
    assert pick("zmq", tcp="x:2") == "zmq"
    with pytest.raises(ValueError, match="unknown KV backend"):
        backend("carrier-pigeon")


async def test_a_broken_tcp_stream_refuses_its_transfer_frees_blocks_and_reconnects():
    pair = await Pair("tcp", capacity=600).start()
    total = len(pair.free)
    try:
        t = pair.sender.begin("cut", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        assert t.backend == "tcp"
        host, port = pair.tcp_address.rsplit(":", 1)
        raw = socket.create_connection((host, int(port)))  # "p"'s stream, by hand
        raw.sendall(b"p".ljust(ID_BYTES) + frame_head("cut", 0, t.frame_bytes) + b"x" * 100)
        incoming = pair.intake.incoming
        await until(lambda: "cut" in incoming and incoming["cut"].receiving, 5.0, "receiving")
        raw.close()  # the stream breaks mid-frame
        await until(lambda: bool(pair.refusals) and len(pair.free) == total, 5.0, "refused")
        assert pair.refusals == ["KV stream failed"] and len(pair.free) == total
        pair.sender.release("cut")
        ok = await pair.send("after", 37, [7, 8, 9], layerwise=False)  # a fresh stream
        assert digest(pair.dst, ok.block_table, 37) == digest(pair.src, [7, 8, 9], 37)
    finally:
        await pair.close()


async def test_tcp_frames_before_their_header_unknown_frames_and_a_stalled_peer():
    """The tcp stream is self-describing: a frame may arrive before its header (ZeroMQ is
    another connection), a frame nobody reserved is read and dropped without losing step, and
    a peer that stalls mid-frame holds up no other peer's transfers."""
    pair = await Pair("tcp", capacity=600).start()
    host, port = pair.tcp_address.rsplit(":", 1)
    ghost = socket.create_connection((host, int(port)))
    early = socket.create_connection((host, int(port)))
    dealer = make_socket(pair.ctx, "node.data_out", pair.target.data_address, identity="p2")
    try:
        n, table = 40, [0, 1, 2]
        size = pair.src.kv_store.frame_bytes(n)
        ghost.sendall(b"ghost".ljust(ID_BYTES) + frame_head("nobody.0", 0, 1000) + b"z" * 1000)
        ghost.sendall(frame_head("nobody.1", 0, size) + b"z" * 100)  # then silence
        # "p2" sends every frame first, its header a moment later
        early.sendall(b"p2".ljust(ID_BYTES))
        for layer in range(LAYOUT.num_layers):
            early.sendall(frame_head("early", layer, size))
            for part in pair.src.kv_store.export_parts(layer, table, n):
                early.sendall(part)
        await asyncio.sleep(0.3)
        params = SamplingParams()
        header = KvHeader(request_id="early", prompt_ids=list(range(n)), num_prompt_tokens=n,
                          params=params, num_layers=LAYOUT.num_layers, frame_bytes=size,
                          prefill_node="p2", backend="tcp")  # fmt: skip
        await dealer.send(encode(header))
        await dealer.send(encode(KvDone(request_id="early", first_token_id=1)))
        intake = await asyncio.wait_for(pair.admitted.get(), 3)
        assert digest(pair.dst, intake.block_table, n) == digest(pair.src, table, n)
        pair.release(intake.block_table)
        # the real sender's transfers are not held up by the stalled ghost
        ok = await asyncio.wait_for(pair.send("after", 33, [7, 8, 9], layerwise=True), 3)
        assert digest(pair.dst, ok.block_table, 33) == digest(pair.src, [7, 8, 9], 33)
        assert not pair.refusals
    finally:
        ghost.close()
        early.close()
        dealer.close()
        await pair.close()


async def test_a_tcp_frame_whose_header_is_refused_is_dropped_at_once_not_after_a_timeout():
    """A frame may arrive before its header; if that header is then refused (no room), the
    frame is discarded as soon as the refusal is known. It waited the whole transfer timeout
    instead, the stream behind it stalled, and the sender's next header queued behind that."""
    pair = await Pair("tcp", capacity=600).start()
    host, port = pair.tcp_address.rsplit(":", 1)
    early = socket.create_connection((host, int(port)))
    dealer = make_socket(pair.ctx, "node.data_out", pair.target.data_address, identity="p3")
    try:
        n = 40
        size = pair.src.kv_store.frame_bytes(n)
        early.sendall(b"p3".ljust(ID_BYTES) + frame_head("full", 0, size) + b"z" * size)
        await until(lambda: "full" in pair.intake.arrivals, 5.0, "the listener waits for it")
        pair.free = []  # no room: the header is refused
        header = KvHeader(request_id="full", prompt_ids=list(range(n)), num_prompt_tokens=n,
                          params=SamplingParams(), num_layers=LAYOUT.num_layers,
                          frame_bytes=size, prefill_node="p3", backend="tcp")  # fmt: skip
        started = asyncio.get_running_loop().time()
        await dealer.send(encode(header))
        await until(lambda: "full" not in pair.intake.arrivals, 5.0, "the refused frames dropped")
        waited = asyncio.get_running_loop().time() - started
        assert waited < 2.5, waited  # at once, not at the intake's 10 s wait for a header
        assert "full" in pair.intake.closed
    finally:
        early.close()
        dealer.close()
        await pair.close()


# -- a backend is one module plus one registry line ------------------------------------------
class CopySend(SendConnector):
    """A toy backend: each frame staged as one bytes object, sent as one ZeroMQ part."""

    def stage(self, t: Transfer, layer: int) -> bytes:
        return bytes(self.local.kv.export_frame(layer, t.block_table, t.num_tokens))

    def descriptor(self, t: Transfer, layer: int, payload: bytes) -> list[bytes]:
        return [payload]


class CopyReceive(ReceiveConnector):
    async def listen(self, sink: object) -> str:
        return "here"

    async def frame(self, rec: Intake, layer: int, parts: list) -> object:
        return parts[0] if len(parts) == 1 else None


CONNECTOR = Backend("copy", CopySend, CopyReceive)


async def test_a_new_backend_is_one_module_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(REGISTERED, "copy", __name__)  # the one line in BACKENDS
    pair = await Pair("copy", capacity=300).start()
    try:
        assert pair.endpoints["copy"] == "here"
        for i, n in enumerate([5, 16, 100]):
            table = list(range(i, i + 7))[: -(-n // BLOCK)]
            intake = await pair.send(f"c{i}", n, table, layerwise=i == 1)
            assert intake.header.backend == "copy"
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, table, n)
            pair.release(intake.block_table)
    finally:
        await pair.close()


async def test_a_transfer_ended_while_its_frame_lands_frees_its_blocks_once_landed():
    """Abort (or KvDone of a dropped transfer) may arrive on ZeroMQ while the tcp reader is
    filling that transfer's blocks: the blocks go back only after the frame landed."""
    pair = await Pair("tcp", capacity=600).start()
    total = len(pair.free)
    host, port = pair.tcp_address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)))
    dealer = make_socket(pair.ctx, "node.data_out", pair.target.data_address, identity="p3")
    try:
        n = 40
        size = pair.src.kv_store.frame_bytes(n)
        header = KvHeader(request_id="mid", prompt_ids=list(range(n)), num_prompt_tokens=n,
                          params=SamplingParams(), num_layers=LAYOUT.num_layers,
                          frame_bytes=size, prefill_node="p3", backend="tcp")  # fmt: skip
        await dealer.send(encode(header))
        raw.sendall(b"p3".ljust(ID_BYTES) + frame_head("mid", 0, size) + b"x" * (size // 2))
        incoming = pair.intake.incoming
        await until(lambda: "mid" in incoming and incoming["mid"].receiving, 5.0, "receiving")
        assert len(pair.free) < total  # reserved, half a frame landed
        await dealer.send(encode(Abort(request_id="mid")))
        # the abort taken (the intake marked dropped), the blocks must still be held: a check
        # on the state, not after a sleep that a slow host could cut short
        await until(lambda: incoming["mid"].dropped, 5.0, "the abort taken")
        assert len(pair.free) < total  # still landing: not released under the reader
        raw.sendall(b"x" * (size - size // 2))
        await until(lambda: len(pair.free) == total, 5.0, "freed once landed")
        assert len(pair.free) == total and "mid" not in pair.intake.incoming
    finally:
        raw.close()
        dealer.close()
        await pair.close()


async def test_a_peer_unused_for_long_is_let_go_and_comes_back_when_needed():
    """Every decode node ever sent to kept a DEALER, two tasks and ZeroMQ's reconnecting for
    good (pods scaled away, restarted under new names): one idle past PEER_IDLE_S is let go
    at the next message to anyone, one with a transfer in flight never is, and one let go
    is served again on its next message (its ROUTER takes the new channel over)."""
    from pdserve.common.kv import sender as sender_module

    pair = await Pair("zmq", capacity=600).start()
    try:
        intake = await pair.send("r0", 17, [0, 1], layerwise=False)
        pair.release(intake.block_table)
        gone = DecodeTarget(node_id="gone", data_address="tcp://127.0.0.1:9", host_id="x",
                            kv_endpoints={})  # fmt: skip
        pair.sender.send_message(gone, Abort(request_id="nothing"))
        assert set(pair.sender.peers) == {"d", "gone"}
        await until(lambda: all(p.outbox.empty() for p in pair.sender.peers.values()))
        busy = pair.sender.begin("r1", pair.target, list(range(17)), 17, SamplingParams(), [2, 3])
        for peer in pair.sender.peers.values():  # both idle past the limit (the clock moved)
            peer.used_at -= 2 * sender_module.PEER_IDLE_S
        pair.sender.swept_at -= sender_module.PEER_IDLE_S
        pair.sender.send_message(pair.target, Abort(request_id="nothing"))  # a sweep first
        assert set(pair.sender.peers) == {"d"}  # "gone" let go; "d" has r1 in transfer
        pair.sender.abort(busy.request_id)
        intake = await pair.send("r2", 17, [4, 5], layerwise=False)  # still served
        pair.release(intake.block_table)
        for i in range(10):  # "d" let go, then needed again at once, its ROUTER alive: the
            # new channel (the same identity) must be taken, not ignored for good
            pair.sender.peers["d"].used_at -= 2 * sender_module.PEER_IDLE_S
            pair.sender.swept_at -= sender_module.PEER_IDLE_S
            pair.sender.send_message(gone, Abort(request_id="nothing"))
            assert "d" not in pair.sender.peers
            intake = await pair.send(f"again{i}", 17, [6, 7], layerwise=False)
            pair.release(intake.block_table)
    finally:
        await pair.close()
