"""Cross-node prefix reuse (common/node/fetch.py): a prefill node that misses a prefix another
node's cache holds fetches those blocks over the KV connectors instead of computing them;
byte-exact on the real model, falling back to computing when the holder dies mid-fetch, and
at hundreds of concurrent streams on the sim engine."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import zmq

from pdserve.common.config import EngineConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import (
    TO_PREFILL_DECODER,
    KvFetch,
    KvHeader,
    KvLayer,
    KvRefuse,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
    encode,
)
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import SIM, TIMEOUT, Cluster, digest, outcome, own_cache, until
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def fetched(node: Any, result: str = "fetched") -> float:
    value = node.metrics.registry.get_sample_value(
        "pdserve:kv_fetches_total", {**node.metrics.labels, "result": result}
    )
    return value or 0.0


def idle(*nodes: Any) -> bool:
    return all(
        not n.requests
        and n.blocks.num_in_use_blocks == 0
        and not n.kv.fetches.fetching
        and not n.kv.fetches.pins
        and not n.kv.fetches.serving
        and not n.intake.incoming
        for n in nodes
    )


async def holder_and_decode(c: Cluster, ecfg: EngineConfig, runners: list[Any]) -> Any:
    """prefill-0 and a decode node that keeps no prefix cache: after a first request, the
    index sees the prefix on prefill-0 alone, so that is the hint for any other node."""
    off = dataclasses.replace(ecfg, prefix_caching="off")
    holder = await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=runners[0]))
    await c.add(c.node(DecodeRole, "decode-0", ecfg=off, engine=runners[1]))
    return holder


async def test_a_prefix_another_node_holds_is_fetched_byte_exact(tokenizer, torch_runners):
    ecfg, r0, r1, r2 = torch_runners
    shared = tokenizer.encode("Summarise the following report. " * 80)[:320]
    second_prompt = shared + tokenizer.encode(" In one sentence:")
    assert len(shared) == 320
    expected = make_engine(own_cache(r0), tokenizer, prefix_caching="off").generate(
        [second_prompt], GREEDY
    )[0]
    async with Cluster(tokenizer) as c:
        holder = await holder_and_decode(c, ecfg, [r0, r1])
        first = c.request("first", shared + tokenizer.encode(" Briefly:"), GREEDY)
        await asyncio.wait_for(c.gw.service.run(first), 60)
        assert await outcome(first, 60) == Done("length")
        hashes = holder.blocks.hashes(shared)
        await until(lambda: c.gw.index.cached_blocks("prefill-0", hashes) == 20, what="indexed")
        fetcher = await c.add(c.node(PrefillRole, "prefill-1", ecfg=ecfg, engine=r2))
        holder.scheduler.can_take = lambda *a: "batch full"  # type: ignore[method-assign]

        seen: dict[str, tuple[list[str], list[str]]] = {}
        landed = fetcher.kv.fetches.landed

        def comparing(intake: Any) -> None:  # while the holder still pins its blocks
            n = len(intake.header.prompt_ids)
            theirs = holder.blocks.match(holder.blocks.hashes(intake.header.prompt_ids))
            layers = range(r0.model_config.num_layers)
            seen["kv"] = (
                [digest(r0.kv_store.export_kv(i, theirs, n)) for i in layers],
                [digest(r2.kv_store.export_kv(i, intake.block_table, n)) for i in layers],
            )
            landed(intake)

        fetcher.kv.fetches.landed = comparing  # type: ignore[method-assign]
        second = c.request("second", second_prompt, GREEDY)
        await asyncio.wait_for(c.gw.service.run(second), 60)
        assert await outcome(second, 60) == Done("length")
        assert second.output_ids == expected.token_ids  # equal to one process computing all
        theirs, ours = seen["kv"]
        assert len(set(theirs)) == len(theirs) and ours == theirs  # real layers, byte-exact
        assert fetched(fetcher) == 1 and fetched(holder, "served") == 1
        # the fetched 320 tokens were not computed: admission found them cached
        assert fetcher.scheduler.prefix_hits == 320 == fetcher.load().prefix_fetched
        await until(lambda: idle(holder, fetcher), 5, "every block freed")


def shared_prefix(tokenizer: Any) -> list[int]:
    return tokenizer.encode("A long shared system prompt about ships. " * 80)[:320]


async def holder_and_fetcher(c: Cluster, tokenizer: Any, runners: Any) -> tuple[Any, Any]:
    """prefill-0 holds a 320-token prefix (a first request computed it, the index knows);
    prefill-1 (--kv-transfer-timeout 1) joins, and prefill-0 takes no more prompts: the
    next request with that prefix goes to prefill-1, which fetches it from prefill-0."""
    ecfg, r0, r1, r2 = runners
    holder = await holder_and_decode(c, ecfg, [r0, r1])
    first = c.request("first", shared_prefix(tokenizer) + tokenizer.encode(" Go:"), GREEDY)
    await asyncio.wait_for(c.gw.service.run(first), 60)
    assert await outcome(first, 60) == Done("length")
    hashes = holder.blocks.hashes(shared_prefix(tokenizer))
    await until(lambda: c.gw.index.cached_blocks("prefill-0", hashes) == 20, what="indexed")
    fetcher = await c.add(
        c.node(PrefillRole, "prefill-1", ecfg=ecfg, engine=r2, kv_transfer_timeout=1.0)
    )
    holder.scheduler.can_take = lambda *a: "batch full"  # type: ignore[method-assign]
    return holder, fetcher


@pytest.fixture(scope="module")
def second_and_expected(tokenizer, torch_runners) -> tuple[list[int], Any]:
    """The prompt whose prefix the fetcher fetches, and the single-process engine's output
    (greedy, so one computation serves every test that compares with it)."""
    second_prompt = shared_prefix(tokenizer) + tokenizer.encode(" Name one:")
    engine = make_engine(own_cache(torch_runners[1]), tokenizer, prefix_caching="off")
    return second_prompt, engine.generate([second_prompt], GREEDY)[0]


async def test_a_fetch_whose_holder_dies_midway_is_computed_instead(
    tokenizer, torch_runners, second_and_expected
):
    second_prompt, expected = second_and_expected
    async with Cluster(tokenizer) as c:
        holder, fetcher = await holder_and_fetcher(c, tokenizer, torch_runners)
        push_all = holder.sender.push_all

        def half_then_die(t: Any, payloads: list[Any]) -> None:
            push_all(t, payloads[: len(payloads) // 2])  # half the layers, then it is gone
            holder.stopped.set()

        holder.sender.push_all = half_then_die  # type: ignore[method-assign]
        second = c.request("second", second_prompt, GREEDY)
        await asyncio.wait_for(c.gw.service.run(second), 60)
        assert await outcome(second, 60) == Done("length")
        assert second.output_ids == expected.token_ids
        assert fetched(fetcher, "fell_back") == 1 and fetched(fetcher) == 0
        assert fetcher.scheduler.prefix_hits == 0 == fetcher.load().prefix_fetched
        await until(lambda: idle(fetcher), 5, "the abandoned fetch's blocks freed")


async def test_a_fetch_that_lands_too_slowly_is_given_up_before_its_holder_unpins(
    tokenizer, torch_runners, second_and_expected
):
    """A holder pins what it serves for 3 x --kv-transfer-timeout; a fetch whose layers keep
    landing, but too slowly to end before that, is given up at 2 x (else the holder's
    frames still queued could read blocks it reused, cached here as the prefix)."""
    second_prompt, expected = second_and_expected
    async with Cluster(tokenizer) as c:
        holder, fetcher = await holder_and_fetcher(c, tokenizer, torch_runners)
        sender, loop = holder.sender, asyncio.get_running_loop()
        push, done = sender.push, sender.done

        def later(t: Any, delay: float, send: Any) -> None:  # while the holder still serves it
            loop.call_later(delay, lambda: t.request_id in sender.transfers and send())

        def slowly(t: Any, payloads: list[Any]) -> None:  # a layer every 0.2 s: ~6 s in all
            for i, p in enumerate(payloads):
                later(t, 0.2 * (i + 1), lambda t=t, i=i, p=p: push(t, i, p))
            sender.done = lambda t, token: later(t, 0.2 * (len(payloads) + 1),
                                                 lambda: done(t, token))  # fmt: skip

        sender.push_all = slowly  # type: ignore[method-assign]
        second = c.request("second", second_prompt, GREEDY)
        await asyncio.wait_for(c.gw.service.run(second), 60)
        assert await outcome(second, 60) == Done("length")
        assert second.output_ids == expected.token_ids
        assert fetched(fetcher, "fell_back") == 1 and fetched(fetcher) == 0
        await until(lambda: idle(fetcher), 5, "the abandoned fetch's blocks freed")


async def test_a_malformed_or_unanswerable_fetch_is_refused_and_the_node_goes_on(tokenizer):
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        dealer = make_socket(c.gw.link.ctx, "node.data_out", node.kv.address, identity="peer-x")
        me = DecodeTarget(node_id="peer-x", data_address="tcp://127.0.0.1:1", host_id="h")
        someone = DecodeTarget(
            node_id="someone-else", data_address="tcp://127.0.0.1:1", host_id="h"
        )
        asks = [
            KvFetch(request_id="a", prompt_ids=list(range(32)), skip_tokens=0, reply_to=someone),
            KvFetch(request_id="b", prompt_ids=list(range(30)), skip_tokens=0, reply_to=me),
            KvFetch(request_id="c", prompt_ids=list(range(32)), skip_tokens=32, reply_to=me),
            KvFetch(request_id="d", prompt_ids=list(range(32)), skip_tokens=0, reply_to=me),
        ]
        try:
            for ask in asks:
                await dealer.send(encode(ask))
            await dealer.send(b"\xc1 not msgpack")
            replies = []
            for _ in asks:
                assert await dealer.poll(int(TIMEOUT * 1000), zmq.POLLIN)
                replies.append(TO_PREFILL_DECODER.decode(await dealer.recv()))
        finally:
            dealer.close()
        assert all(isinstance(r, KvRefuse) for r in replies)
        assert [r.request_id for r in replies] == ["a", "b", "c", "d"]
        assert "no longer cached" in replies[-1].reason  # well formed, but nothing held
        assert not node.kv.fetches.serving and node.blocks.num_in_use_blocks == 0
        req = c.request("after", list(range(1000, 1040)))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")


async def test_hundreds_of_streams_fetch_shared_prefixes_and_free_everything(tokenizer):
    """Two small prefill nodes: on-demand offers each request to the one holding its prefix,
    which is often full, so the other fetches the prefix from it (or from the decode node)."""
    # prefill caches of 6,400 tokens for 40 prefixes of 256: they evict, and fetch again.
    # Passes 4x the modelled time: a holder stays full while the gateway offers its requests
    # to the other node (at 1x, a loaded host placed the whole load with no fetch at all)
    small = dataclasses.replace(SIM, sim_time_scale=4.0, max_batch=4, num_kv_blocks=400)
    big = dataclasses.replace(SIM, num_kv_blocks=8192)
    async with Cluster(tokenizer, placement_timeout=60.0) as c:
        prefills = [
            await c.add(c.node(PrefillRole, f"prefill-{i}", ecfg=small, engine=SimEngine(small)))
            for i in range(2)
        ]
        decode = await c.add(c.node(DecodeRole, "decode-0", ecfg=big, engine=SimEngine(big)))
        prefixes = [list(range(1000 + 300 * g, 1000 + 300 * g + 256)) for g in range(40)]
        # a first pass puts every prefix in one cache, then the load arrives
        warm = [c.request(f"warm{g}", [*p, 7]) for g, p in enumerate(prefixes)]
        await asyncio.wait_for(asyncio.gather(*(c.gw.service.run(r) for r in warm)), 30)
        assert [await outcome(r, 30) for r in warm] == [Done("length")] * len(warm)
        # the load's offers name a holder only from the gateway's prefix index (the nodes'
        # KV events ride in their heartbeats): wait until it agrees with every prefill
        # node's cache, or a loaded host places the whole load before it knows anything
        hashes = [prefills[0].blocks.hashes(p) for p in prefixes]

        def indexed() -> bool:
            return all(
                c.gw.index.cached_blocks(n.node_id, h) == len(n.blocks.match(h))
                for n in prefills
                for h in hashes
            )

        await until(indexed, 10, "the gateway's index of the warm prefixes")
        reqs = [
            c.request(f"r{i}", prefixes[i % 40] + list(range(500 + i * 20, 516 + i * 20)))
            for i in range(240)
        ]
        await asyncio.wait_for(asyncio.gather(*(c.gw.service.run(r) for r in reqs)), 60)
        results = [await outcome(r, 30) for r in reqs]
        assert results == [Done("length")] * len(reqs)
        assert all(len(r.output_ids) == 5 for r in reqs)
        assert sum(fetched(p) for p in prefills) > 0
        await until(lambda: idle(*prefills, decode), 10, "every node idle with every block freed")
        nodes = [*prefills, decode]  # each fetch landed once and its holder saw the ack
        assert sum(fetched(n) for n in nodes) == sum(fetched(n, "served") for n in nodes)


async def test_kv_headers_a_cache_cannot_hold_are_refused_before_any_block_is_reserved(tokenizer):
    """Headers on a decode node's data socket with more or fewer layers than its cache (a
    layer past its last raised mid-frame and held the blocks for good; fewer completed the
    request with the others' blocks unwritten), a skipped prefix outside the prompt, or
    another node named as sender: each is refused at once, nothing reserved, and the node
    serves on."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        dealer = make_socket(c.gw.link.ctx, "node.data_out", decode.kv.address, identity="peer-x")
        kv = decode.engine.kv_store
        ok = {"prompt_ids": list(range(32)), "num_prompt_tokens": 32, "params": GREEDY,
              "num_layers": kv.num_layers, "frame_bytes": kv.frame_bytes(32),
              "prefill_node": "peer-x", "gateway": decode.control.links[0].gateway_id}  # fmt: skip
        bad = [
            ("more", {"num_layers": kv.num_layers + 1}),
            ("fewer", {"num_layers": kv.num_layers - 1}),
            ("none", {"num_layers": 0}),
            ("negative-skip", {"skip_tokens": -16, "frame_bytes": kv.frame_bytes(48)}),
            ("skip-all", {"skip_tokens": 32, "frame_bytes": kv.frame_bytes(0)}),
            ("other-sender", {"prefill_node": "prefill-0"}),
        ]
        try:
            for rid, fields in bad:
                await dealer.send(encode(KvHeader(request_id=rid, **{**ok, **fields})))
            replies = []
            for _ in bad:
                assert await dealer.poll(int(TIMEOUT * 1000), zmq.POLLIN)
                replies.append(TO_PREFILL_DECODER.decode(await dealer.recv()))
        finally:
            dealer.close()
        assert all(isinstance(r, KvRefuse) for r in replies), replies
        assert sorted(r.request_id for r in replies) == sorted(rid for rid, _ in bad)
        assert decode.blocks.num_in_use_blocks == 0 and not decode.intake.incoming
        req = c.request("after", list(range(1000, 1040)))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")


async def test_a_sender_gone_mid_transfer_is_refused_into_the_void_and_the_node_goes_on(
    tokenizer,
):
    """A prefill node that sent a header and a layer, then went away (crashed, scaled down):
    at the stall timeout the decode node frees the reservation and refuses it to a peer its
    ROUTER can no longer route to; that send raised and ended the expiry loop, which stopped
    the node (a watched task) with every stream on it."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        dealer = make_socket(c.gw.link.ctx, "node.data_out", decode.kv.address, identity="peer-y")
        kv = decode.engine.kv_store
        gateway = decode.control.links[0].gateway_id
        header = KvHeader(request_id="gone", prompt_ids=list(range(32)), num_prompt_tokens=32,
                          params=GREEDY, num_layers=kv.num_layers, frame_bytes=kv.frame_bytes(32),
                          prefill_node="peer-y", gateway=gateway)  # fmt: skip
        await dealer.send(encode(header))
        await until(lambda: "gone" in decode.intake.incoming, what="the reservation")
        frame = bytes(kv.frame_bytes(32))
        await dealer.send_multipart([encode(KvLayer(request_id="gone", layer=0)), frame])
        await until(lambda: decode.intake.incoming["gone"].progress > 0, what="its first layer")
        dealer.close(linger=0)
        # the stall timeout, now (the gateway's lease would free the unknown id first);
        # whether or not the ROUTER has seen the close yet, nothing may raise
        await decode.intake.expire(time.monotonic() + 60)
        assert "gone" not in decode.intake.incoming and decode.blocks.num_in_use_blocks == 0
        await decode.intake.refuse(b"never-connected", "gone", "a peer the ROUTER cannot route")
        assert not decode.stopped.is_set()
        req = c.request("after", list(range(1000, 1040)))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")
