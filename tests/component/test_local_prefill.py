"""Selective disaggregation (`--local-prefill`): a request its decode node prefills itself
streams the same tokens as a disaggregated one (sim ids under load; greedy SmolLM2 text
equal to the single-process engine's), with no KV transfer and no prefill node involved;
the decision and its inputs are in the request's timeline."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import KvHeader
from pdserve.common.wire.protocol import Accept, DecodeTarget, PrefillOffer, Reject
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.component.cluster import PARAMS, Cluster, outcome, own_cache, prompt
from tests.conftest import make_engine

FAST = EngineConfig(engine="sim", sim_time_scale=0.02, num_kv_blocks=4096)


@pytest.mark.parametrize("mode", ["always", "64"])
async def test_local_prefill_under_load_streams_the_same_tokens(tokenizer, mode):
    """`always`: every request on its decode node; `64`: prompts of at most 64 tokens."""
    async with Cluster(tokenizer, local_prefill=mode) as c:
        p = await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
        d0 = await c.add(c.node(DecodeRole, "decode-0", ecfg=FAST))
        d1 = await c.add(c.node(DecodeRole, "decode-1", ecfg=FAST))
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
        reqs = [
            c.request(f"l{i}", prompt(20 + 9 * (i % 10), 900 + 97 * i), params) for i in range(200)
        ]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        results = [await outcome(r, 60) for r in reqs]
        await asyncio.gather(*runs)
        assert results == [Done("length")] * 200
        for r in reqs:
            assert r.output_ids == _sim_ids(r.prompt_ids, 8, 12), r.request_id
            local = r.ran_on["prefill"] == r.ran_on["decode"]
            assert local == (mode == "always" or len(r.prompt_ids) <= 64), r.request_id
            assert r.timeline["local_prefill.0"]["local"] == local
        here = d0.metrics.local_prefills._value.get() + d1.metrics.local_prefills._value.get()
        assert here == sum(r.ran_on["prefill"] != "prefill-0" for r in reqs) > 0
        assert c.gw.metrics.local_prefills._value.get() == here
        assert (
            p.metrics._offers.labels(**p.metrics.labels, decision="accept")._value.get() == 0
        ) == (mode == "always")
        for node in (p, d0, d1):
            assert not node.requests and node.blocks.num_in_use_blocks == 0
        assert not c.gw.table


async def test_greedy_text_is_the_same_prefilled_locally_or_disaggregated(tokenizer, torch_runners):
    ecfg, r0, r1, _ = torch_runners
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = tokenizer.encode("<|im_start|>user\nWhat is a river?<|im_end|>\n<|im_start|>assistant\n")
    expected = make_engine(own_cache(r0), tokenizer, prefix_caching="off").generate([ids], greedy)
    outputs = []
    # the last: its decode node prefills it in chunks of 8 (--chunk-size bounds its stall)
    chunked = dataclasses.replace(ecfg, chunk_size=8, max_batch=8)
    for mode, decode_cfg in (("off", ecfg), ("always", ecfg), ("always", chunked)):
        async with Cluster(tokenizer, local_prefill=mode) as c:
            await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=own_cache(r0)))
            await c.add(c.node(DecodeRole, "decode-0", ecfg=decode_cfg, engine=own_cache(r1)))
            req = c.request(f"g-{mode}", ids, greedy)
            run = asyncio.create_task(c.gw.service.run(req))
            assert await outcome(req, 60) == Done("length")
            await run
            assert (req.ran_on["prefill"] == "decode-0") == (mode == "always")
            outputs.append(req.output_ids)
    assert outputs[0] == outputs[1] == outputs[2] == expected[0].token_ids


async def test_a_local_prefill_is_timed_and_counted_whatever_its_finish(tokenizer):
    """Its FirstToken carried no prefill or queue time: the gateway's phase histograms took
    zeros for every local prefill, and the decode node recorded neither (nor its prompt
    tokens). And a first token that was also the last (max_tokens=1) went uncounted at the
    gateway, while the node had counted it at its Accept."""
    async with Cluster(tokenizer, local_prefill="always") as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
        d = await c.add(c.node(DecodeRole, "decode-0", ecfg=FAST))
        reqs = [
            c.request(f"t{n}", prompt(40, 300 + n), SamplingParams(max_tokens=n, ignore_eos=True))
            for n in (1, 4)
        ]
        for r in reqs:
            await c.gw.service.run(r)
            assert await outcome(r, 30) == Done("length")
            assert r.ran_on["prefill"] == "decode-0"
            assert r.phases()["prefill_ms"] > 0 and "prefill_queue_ms" in r.phases()
        counted = d.metrics.local_prefills._value.get(), c.gw.metrics.local_prefills._value.get()
        assert counted == (2, 2)
        node, gw = d.metrics.registry.get_sample_value, c.gw.metrics.registry.get_sample_value
        assert node("pdserve:request_prefill_time_seconds_count", d.metrics.labels) == 2
        assert node("pdserve:request_queue_time_seconds_count", d.metrics.labels) == 2
        assert node("pdserve:prompt_tokens_total", d.metrics.labels) == 80
        assert gw("pdserve:request_prefill_time_seconds_sum") > 0


async def test_an_accepted_local_prompt_keeps_its_blocks_until_it_is_admitted(tokenizer):
    """The scheduler allocates a local prompt's blocks at admission, and the accept check
    looked only at the blocks free now: a second offer in the same step (another gateway's)
    or a KV header was given the same blocks, and the node's load reported them as free."""
    small = dataclasses.replace(FAST, num_kv_blocks=16)  # 256 tokens, no watermark block
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
        d = await c.add(c.node(DecodeRole, "decode-0", ecfg=small))
        sent: list = []

        async def keep(msg) -> None:  # the answers: the gateway made no such offer
            sent.append(msg)

        d.send_gateway = keep
        wake, d.steps.wake = d.steps.wake, lambda: None  # both offers before the next step
        target = DecodeTarget(node_id="decode-0", data_address="", host_id="h")
        for rid, n in (("a", 150), ("b", 100)):  # 10 blocks, then 7: 17 of 16
            offer = PrefillOffer(request_id=rid, prompt_ids=prompt(n), params=PARAMS, decode=target)
            await d.role.on_gateway_message(offer)
        assert [type(m) for m in sent] == [Accept, Reject], sent
        kv = KvHeader(request_id="k", prompt_ids=prompt(100), num_prompt_tokens=100,
                      params=PARAMS, num_layers=1, prefill_node="prefill-0", fetch=True,
                      frame_bytes=d.engine.kv_store.frame_bytes(100))  # fmt: skip
        assert isinstance(d.role.reserve_kv(kv), str)  # KV headed here does not take them
        load = d.load()
        assert load.blocks_free + load.blocks_cached == 16 - 10 and load.blocks_in_use == 10
        d.steps.wake = wake
        d.abort("a")
        assert d.load().blocks_free + d.load().blocks_cached == 16
