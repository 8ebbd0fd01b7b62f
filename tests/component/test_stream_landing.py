"""The tcp stream's readers claim and land frames from their own threads, under the intake's
lock, without the event loop (common/kv/landing.py). What that must keep: a claim never
writes into blocks a drop gave back, a drop during a landing frees the blocks once it has
landed, two streams never write one transfer at once, and a transfer completes exactly once
whichever of its last frame and its KvDone comes last. A real intake and cache; the test's
own threads act as the stream readers."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from pdserve.common.kv.landing import ASK_LOOP
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import KvDone, KvHeader
from pdserve.common.wire.protocol import encode
from pdserve.common.wire.transport import make_socket
from tests.component.cluster import until
from tests.component.test_kv_backends import LAYOUT, Pair, digest

PEER = "p3"
N = 40  # tokens a transfer: 3 blocks of 16


def header(rid: str, size: int) -> KvHeader:
    return KvHeader(request_id=rid, prompt_ids=list(range(N)), num_prompt_tokens=N,
                    params=SamplingParams(), num_layers=LAYOUT.num_layers, frame_bytes=size,
                    prefill_node=PEER, backend="tcp")  # fmt: skip


class Peer:
    """A prefill node's ZeroMQ channel (headers, KvDone) beside frames claimed directly."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.size = pair.dst.kv_store.frame_bytes(N)
        self.dealer = make_socket(pair.ctx, "node.data_out", pair.target.data_address,
                                  identity=PEER)  # fmt: skip

    async def open(self, rid: str) -> None:
        await self.dealer.send(encode(header(rid, self.size)))
        await until(lambda: rid in self.pair.intake.incoming, 5.0, "the header taken")

    async def done(self, rid: str) -> None:
        await self.dealer.send(encode(KvDone(request_id=rid, first_token_id=1)))

    def claim(self, rid: str, layer: int):  # type: ignore[no-untyped-def]
        return self.pair.intake.landing.claim_frame(PEER, rid, layer, self.size)

    def written(self, rid: str, layer: int):  # type: ignore[no-untyped-def]
        return self.pair.intake.landing.frame_written(PEER, rid, layer)


async def test_a_claim_and_a_drop_exclude_each_other() -> None:
    pair = await Pair("tcp", capacity=600).start()
    peer = Peer(pair)
    total = len(pair.free)
    try:
        assert peer.claim("early", 0) is ASK_LOOP  # no header yet: the loop waits for it
        await peer.open("r")
        views = peer.claim("r", 0)
        assert isinstance(views, list) and sum(len(v) for v in views) == peer.size
        intake = pair.intake.incoming["r"]
        assert intake.receiving
        assert peer.claim("r", 1) is None  # landing on one stream: another may not write it
        assert pair.intake.drop("r")
        assert len(pair.free) == total - 3  # held: a frame is being written into them
        assert peer.claim("r", 1) is None  # dropped: read and discarded
        rest = peer.written("r", 0)
        assert rest is not None and len(pair.free) == total - 3
        await rest  # on the loop: the blocks go back, the transfer is forgotten
        assert len(pair.free) == total and "r" not in pair.intake.incoming
        assert peer.claim("r", 2) is None  # closed: never waited for again
        assert peer.claim("r", 0) is None
    finally:
        peer.dealer.close()
        await pair.close()


@pytest.mark.parametrize("order", ["kvdone-first", "frames-first", "both-see-it-complete"])
async def test_a_transfer_completes_once_whichever_comes_last(order: str) -> None:
    pair = await Pair("tcp", capacity=600).start()
    peer = Peer(pair)
    try:
        await peer.open("r")
        intake = pair.intake.incoming["r"]
        if order != "frames-first":
            await peer.done("r")
            await until(lambda: intake.first_token is not None, 5.0, "KvDone taken")
        rests = []
        for layer in range(LAYOUT.num_layers):
            views = peer.claim("r", layer)
            for v in views:
                v[:] = bytes(len(v))
            rests.append(peer.written("r", layer))
        # only the frame that completed it hands work back to the loop
        assert all(r is None for r in rests[:-1])
        assert (rests[-1] is not None) == (order != "frames-first")
        assert pair.admitted.empty()
        if order == "both-see-it-complete":  # KvDone's handler finished it in between
            await pair.intake.finish(intake)
            await rests[-1]
        elif order == "kvdone-first":
            await rests[-1]
        else:
            await peer.done("r")
        admitted = await asyncio.wait_for(pair.admitted.get(), 5)
        assert admitted.header.request_id == "r" and "r" not in pair.intake.incoming
        assert peer.claim("r", 0) is None
        await asyncio.sleep(0)
        assert pair.admitted.empty()  # once
    finally:
        peer.dealer.close()
        await pair.close()


async def test_readers_claiming_while_the_loop_drops_never_lose_or_share_a_block() -> None:
    """Two reader threads land 60 transfers' frames while the loop drops a third of them, ten
    surely between a frame's claim and its landing, the others at random moments: every
    block comes back exactly once, every transfer ends (admitted or dropped), and no block
    is given back while a frame is written into it."""
    pair = await Pair("tcp", capacity=60 * 48).start()  # room for all: 3 blocks each
    peer = Peer(pair)
    total = sorted(pair.free)
    rng = random.Random(7)
    rids = [f"r{i}" for i in range(60)]
    loop = asyncio.get_running_loop()
    errors: list[str] = []
    gone: set[str] = set()

    victims = set(rng.sample(rids, 10))  # dropped by the loop while a frame lands, surely
    asked: asyncio.Queue[tuple[str, threading.Event]] = asyncio.Queue()

    def read(mine: list[str]) -> None:
        for rid in mine:
            mid = rng.randrange(LAYOUT.num_layers) if rid in victims else -1
            for layer in range(LAYOUT.num_layers):
                views = peer.claim(rid, layer)
                if views is None:
                    continue
                blocks = set(pair.intake.incoming[rid].block_table)
                if layer == mid:  # the loop drops it now, between claim and landing
                    dropped = threading.Event()
                    loop.call_soon_threadsafe(asked.put_nowait, (rid, dropped))
                    dropped.wait(10)
                time.sleep(0)  # the loop may drop it now: its blocks must stay held
                if not blocks.isdisjoint(pair.free):
                    errors.append(f"{rid}: its blocks given back while a frame landed")
                rest = peer.written(rid, layer)
                if rest is not None:
                    asyncio.run_coroutine_threadsafe(rest, loop)

    async def drop_when_asked() -> None:
        while True:
            rid, dropped = await asked.get()
            if pair.intake.drop(rid):
                gone.add(rid)
            dropped.set()

    try:
        for rid in rids:
            await peer.open(rid)
            await peer.done(rid)
        await until(lambda: all(pair.intake.incoming[r].first_token for r in rids), 5.0)
        dropper = asyncio.create_task(drop_when_asked())
        readers = [threading.Thread(target=read, args=(rids[i::2],)) for i in range(2)]
        for t in readers:
            t.start()
        for rid in rng.sample(rids, 20):  # and others at any moment
            await asyncio.sleep(rng.random() * 0.002)
            if pair.intake.drop(rid):
                gone.add(rid)
        for t in readers:
            await asyncio.to_thread(t.join)
        dropper.cancel()
        assert victims <= gone
        await until(lambda: not pair.intake.incoming, 10.0, "every transfer ended")
        admitted = [pair.admitted.get_nowait() for _ in range(pair.admitted.qsize())]
        assert not errors
        assert {a.header.request_id for a in admitted} == set(rids) - gone
        held = [b for a in admitted for b in a.block_table]
        assert sorted(pair.free + held) == total  # each block once: none lost, none shared
    finally:
        peer.dealer.close()
        await pair.close()


async def test_a_header_whose_frame_size_is_not_the_cache_layouts_is_refused() -> None:
    """A header's frame_bytes is the sender's word: where it disagrees with this cache's
    layout (another dtype or head layout) the header is refused at once, nothing reserved,
    and its frames are read and discarded (views of another size would take more or fewer
    bytes than the frame has, and the stream would fall out of step)."""
    pair = await Pair("tcp", capacity=600).start()
    peer = Peer(pair)
    peer.size += 64  # a header that lies about its frames
    total = len(pair.free)
    try:
        await peer.dealer.send(encode(header("r", peer.size)))
        await until(lambda: "r" in pair.intake.closed, 5.0, "the header refused")
        assert "r" not in pair.intake.incoming and len(pair.free) == total
        assert peer.claim("r", 0) is None
        landing = pair.intake.landing
        assert await landing.open_frame(PEER, "r", 0, peer.size) is None
    finally:
        peer.dealer.close()
        await pair.close()


async def test_two_hundred_transfers_at_once_land_byte_exact_through_the_readers() -> None:
    """The real path at load: 200 transfers begun at once, their layers interleaved on one
    stream, each claimed and landed by the reader thread into a real CPU cache: every one
    acknowledged once, byte-exact, and every block held by exactly one admitted transfer."""
    n = 5  # tokens: one block each on both sides
    pair = await Pair("tcp", capacity=210 * 16).start()
    total = len(pair.free)
    listener = pair.receivers["tcp"].listener  # type: ignore[attr-defined]
    asked = []  # frames the reader had to ask the loop about (a header not yet come)
    call = listener._call

    def counted(coro):  # type: ignore[no-untyped-def]
        asked.append(1)
        return call(coro)

    listener._call = counted
    try:
        sources = {}
        for i in range(200):
            src = [i % 7]
            t = pair.sender.begin(f"c{i}", pair.target, list(range(n)), n, SamplingParams(), src)
            sources[f"c{i}"] = src
            for layer in range(LAYOUT.num_layers):
                pair.sender.push(t, layer, pair.sender.stage(t, layer))
            pair.sender.done(t, 1)
        acked = [await asyncio.wait_for(pair.acked.get(), 30) for _ in range(200)]
        admitted = [await asyncio.wait_for(pair.admitted.get(), 30) for _ in range(200)]
        assert sorted(t.request_id for t in acked) == sorted(sources)
        assert {a.header.request_id for a in admitted} == set(sources)
        for a in admitted:
            want = digest(pair.src, sources[a.header.request_id], n)
            assert digest(pair.dst, a.block_table, n) == want, a.header.request_id
        held = [b for a in admitted for b in a.block_table]
        assert len(set(held)) == len(held) == 200 and not pair.intake.incoming
        assert sorted(pair.free + held) == list(range(total))
        assert pair.admitted.empty() and not pair.refusals
        # only frames that overtook their header (ZeroMQ) ask, twice each: 206 and 324 of
        # 12,000 calls seen; asking for every frame (open and landed) would be 12,000
        assert len(asked) < 200 * LAYOUT.num_layers, len(asked)
    finally:
        await pair.close()
