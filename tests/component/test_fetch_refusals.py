"""A prefix fetch that cannot go on ends at once on both sides: a fetch header the fetcher's
own intake refuses falls back to computing then (not at its deadline, up to 2 x
--kv-transfer-timeout later), and a holder that cannot start the send refuses it and unpins
(it kept the blocks pinned until its 3 x timeout, and the fetcher heard nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import zmq

from pdserve.common.engine.sim import SimEngine
from pdserve.common.node.fetch import _Fetch
from pdserve.common.wire.kv_messages import TO_PREFILL_DECODER, KvFetch, KvHeader, KvRefuse
from pdserve.common.wire.protocol import DecodeTarget, encode
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import PARAMS, SIM, TIMEOUT, Cluster, outcome, until
from tests.component.test_fetch import fetched


async def _replies(dealer: Any, count: int) -> list[Any]:
    replies = []
    for _ in range(count):
        assert await dealer.poll(int(TIMEOUT * 1000), zmq.POLLIN), "no reply"
        replies.append(TO_PREFILL_DECODER.decode(await dealer.recv()))
    return replies


async def test_a_fetch_header_refused_here_falls_back_at_once(tokenizer):
    """A header from the holder that this node's intake refuses (its layout, an shm segment
    it cannot map) ends the fetch there; one from a third node ends nothing."""
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(PrefillRole, "prefill-0", kv_transfer_timeout=30.0))
        fetches, kv = node.kv.fetches, node.engine.kv_store
        holder = DecodeTarget(node_id="holder-x", data_address="tcp://127.0.0.1:1", host_id="h")
        seq = SimpleNamespace(token_ids=list(range(32)))
        for fid in ("malformed/fetch", "unmapped/fetch", "forged/fetch"):
            fetches.fetching[fid] = _Fetch(fid, seq, holder, 0, 32, [])  # type: ignore[arg-type]
        base = dict(prompt_ids=list(range(32)), num_prompt_tokens=32, params=PARAMS,
                    num_layers=kv.num_layers, frame_bytes=kv.frame_bytes(32),
                    prefill_node="holder-x", fetch=True)  # fmt: skip
        unmapped = {"backend": "shm", "location": "pdserve-seg-holder-x-abcdef-0"}
        headers = [
            ("holder-x", KvHeader(request_id="malformed/fetch", **{**base, "num_layers": 1})),
            ("holder-x", KvHeader(request_id="unmapped/fetch", **{**base, **unmapped})),
            ("peer-z", KvHeader(request_id="forged/fetch", **{**base, "prefill_node": "peer-z"})),
        ]
        dealers = {
            name: make_socket(c.gw.link.ctx, "node.data_out", node.kv.address, identity=name)
            for name in ("holder-x", "peer-z")
        }
        try:
            for name, header in headers:
                await dealers[name].send(encode(header))
            replies = await _replies(dealers["holder-x"], 2)
            replies += await _replies(dealers["peer-z"], 1)
        finally:
            for dealer in dealers.values():
                dealer.close(linger=0)
        assert all(isinstance(r, KvRefuse) for r in replies), replies
        # at once: the fetch's own deadline is 30 s away (it was never even set here)
        await until(lambda: set(fetches.fetching) == {"forged/fetch"}, 2.0, "both fell back")
        assert fetched(node, "fell_back") == 2
        assert node.blocks.num_in_use_blocks == 0  # the unmapped one's reservation freed
        fetches.fetching.clear()


async def test_a_fetch_the_holder_cannot_send_is_refused_and_unpinned_at_once(tokenizer):
    async with Cluster(tokenizer) as c:
        holder = await c.add(c.node(PrefillRole, "prefill-0", kv_transfer_timeout=30.0))
        await c.add(c.node(DecodeRole, "decode-0"))
        prompt = list(range(1000, 1040))
        first = c.request("first", prompt)
        await asyncio.wait_for(c.gw.service.run(first), TIMEOUT)
        assert await outcome(first) == Done("length")
        bm = holder.blocks
        await until(lambda: bm.num_in_use_blocks == 0, what="the first request's blocks freed")
        assert len(bm.match(bm.hashes(prompt[:32]))) == 2  # cached: a fetch finds them

        def cannot(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no way to send")

        holder.kv.sender.begin = cannot  # type: ignore[method-assign]
        me = DecodeTarget(node_id="peer-x", data_address="tcp://127.0.0.1:1", host_id="h")
        ask = KvFetch(request_id="f/fetch", prompt_ids=prompt[:32], skip_tokens=0, reply_to=me)
        dealer = make_socket(c.gw.link.ctx, "node.data_out", holder.kv.address, identity="peer-x")
        try:
            await dealer.send(encode(ask))
            (reply,) = await _replies(dealer, 1)
        finally:
            dealer.close(linger=0)
        assert isinstance(reply, KvRefuse) and reply.request_id == "f/fetch"
        assert "no way to send" in reply.reason
        assert not holder.kv.fetches.serving and bm.num_in_use_blocks == 0


async def test_a_holder_pins_only_what_it_sends_and_never_the_room_it_keeps(tokenizer):
    """A holder pinned every block of the asked prefix, the ones the fetcher already has
    too, with no room check: held up to 3 x --kv-transfer-timeout for nothing, and on a
    decode node, below its watermark, the next step preempted live streams. It pins the
    blocks it sends, and refuses a fetch whose pins would eat into the room it keeps."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        holder = await c.add(c.node(DecodeRole, "decode-0", kv_transfer_timeout=30.0))
        bm, keep = holder.blocks, holder.scheduler.cfg.watermark_blocks
        assert keep > 0
        prompt = list(range(1000, 1048))  # three blocks of 16, cached and idle
        cached = bm.allocate(3)
        bm.register(cached, bm.hashes(prompt))
        bm.free(cached)
        streams = bm.allocate(bm.num_free_blocks - keep - 2)  # room for two pins, no more
        pinned: list[list[int]] = []

        def pins_then_cannot(fid: str, *args: Any, **kwargs: Any) -> Any:
            pinned.append(list(holder.kv.fetches.serving[fid][0]))
            raise RuntimeError("not sending in this test")

        holder.kv.sender.begin = pins_then_cannot  # type: ignore[method-assign]
        me = DecodeTarget(node_id="peer-x", data_address="tcp://127.0.0.1:1", host_id="h")
        asks = [  # all three blocks: past the watermark; the last two: room for them
            KvFetch(request_id="all/fetch", prompt_ids=prompt, skip_tokens=0, reply_to=me),
            KvFetch(request_id="tail/fetch", prompt_ids=prompt, skip_tokens=16, reply_to=me),
        ]
        dealer = make_socket(c.gw.link.ctx, "node.data_out", holder.kv.address, identity="peer-x")
        try:
            for ask in asks:
                await dealer.send(encode(ask))
            replies = await _replies(dealer, 2)
        finally:
            dealer.close(linger=0)
        assert all(isinstance(r, KvRefuse) for r in replies), replies
        assert "no room to pin 3 KV blocks" in replies[0].reason, replies[0]
        assert pinned == [cached[1:]]  # the sent blocks alone, not the one the peer has
        assert not holder.kv.fetches.serving
        assert bm.num_in_use_blocks == len(streams)  # every pin given back
        bm.free(streams)


async def test_a_prefill_holder_keeps_the_room_of_the_prompts_it_accepted(tokenizer):
    """A prefill node keeps no watermark and its role promises nothing, so a peer's fetch
    could pin the idle cached blocks its accepted, waiting prompts are to take: they waited
    until the peer acked, up to 3 x --kv-transfer-timeout. The scheduler's promise counts."""
    from pdserve.common.engine.sequence import Sequence

    async with Cluster(tokenizer) as c:
        holder = await c.add(c.node(PrefillRole, "prefill-0"))
        bm, fetches = holder.blocks, holder.kv.fetches
        prompt = list(range(1000, 1048))  # three blocks of 16, cached and idle
        cached = bm.allocate(3)
        bm.register(cached, bm.hashes(prompt))
        bm.free(cached)
        streams = bm.allocate(bm.num_free_blocks - 4)  # 4 free: the 3 cached, and one
        assert fetches._no_room_to_pin(cached[1:]) is None  # nothing accepted: room
        # accepted and waiting (no await between: the step loop does not run it here)
        holder.scheduler.waiting.append(Sequence.new("w", list(range(1, 41)), PARAMS))
        try:
            assert (
                fetches._no_room_to_pin(cached[1:]) == "no room to pin 2 KV blocks (4 free, 3 kept)"
            )
        finally:
            holder.scheduler.waiting.clear()
        bm.free(streams)


async def test_blocks_an_abandoned_fetch_gives_back_wake_a_prompt_waiting_for_room(tokenizer):
    """A fetch's blocks freed on paths that did not wake the step loop (landed after the
    fetch was abandoned, given up after its request went): a prompt waiting for room slept
    on beside them, as the loop waits until something may be schedulable."""
    async with Cluster(tokenizer, scheduler="round_robin") as c:  # queueing: accepted, waits
        node = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        bm, steps = node.blocks, node.steps
        landing = bm.allocate(bm.num_free_blocks)  # a fetch's reservation, its KV landing
        req = c.request("waiting", list(range(1000, 1040)))
        run = asyncio.create_task(c.gw.service.run(req))
        await until(lambda: len(node.scheduler.waiting) == 1 and not steps.work.is_set(),
                    what="the prompt accepted, waiting for room")  # fmt: skip
        intake = SimpleNamespace(header=SimpleNamespace(request_id="gone/fetch"),
                                 block_table=landing)  # fmt: skip
        node.kv.fetches.landed(intake)  # its fetch was abandoned meanwhile
        assert await outcome(req) == Done("length")
        await run


async def test_a_fetched_prefix_counts_once_in_the_room_a_prefill_node_offers(tokenizer):
    """A prompt whose prefix is landing, or landed and waiting for its pass, was promised its
    whole KV on top of the blocks already held for it (the reservation, then the landed
    blocks pinned), so the node reported less room than it has and refused offers it could
    take. Held blocks count once: the promise is what admission will still take."""
    small = dataclasses.replace(SIM, num_kv_blocks=64)
    off = dataclasses.replace(SIM, prefix_caching="off")
    async with Cluster(tokenizer) as c:
        holder = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=off, engine=SimEngine(off)))
        shared = list(range(1000, 1320))  # 20 blocks of 16
        first = c.request("first", [*shared, 7])
        await asyncio.wait_for(c.gw.service.run(first), TIMEOUT)
        assert await outcome(first) == Done("length")
        hashes = holder.blocks.hashes(shared)
        await until(lambda: c.gw.index.cached_blocks("prefill-0", hashes) == 20, what="indexed")
        fetcher = await c.add(c.node(PrefillRole, "prefill-1", ecfg=small,
                                     engine=SimEngine(small)))  # fmt: skip
        holder.scheduler.can_take = lambda *a: "batch full"  # type: ignore[method-assign]
        fetches, sched = fetcher.kv.fetches, fetcher.scheduler
        reserve, landed = fetches.reserve, fetches.landed
        seen: list[tuple[int, int]] = []

        def room() -> None:
            pending = [f.seq for f in fetches.fetching.values()]
            seen.append((fetcher.blocks.num_free_blocks, sched.room(False, pending)))

        def reserving(h: KvHeader) -> Any:
            table = reserve(h)
            room()  # 20 blocks reserved, landing
            return table

        def landing(intake: Any) -> None:
            landed(intake)
            room()  # 20 blocks pinned, the prompt waiting for its pass

        fetches.reserve, fetches.landed = reserving, landing  # type: ignore[method-assign]
        second = c.request("second", [*shared, *range(1, 17)])  # 21 blocks: 1 to compute
        await asyncio.wait_for(c.gw.service.run(second), TIMEOUT)
        assert await outcome(second) == Done("length")
        assert fetched(fetcher) == 1
        # 44 free, 1 of them the prompt's: 43 blocks of room (its whole 21 promised: 23)
        assert seen == [(44, 43 * 16), (44, 43 * 16)], seen
