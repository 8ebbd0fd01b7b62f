"""Selective disaggregation (`--local-prefill`): a request its decode node prefills itself
streams the same tokens as a disaggregated one (sim ids under load; greedy SmolLM2 text
equal to the single-process engine's), with no KV transfer and no prefill node involved;
the decision and its inputs are in the request's timeline."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.component.cluster import Cluster, outcome, own_cache, prompt
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
    for mode in ("off", "always"):
        async with Cluster(tokenizer, local_prefill=mode) as c:
            await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=own_cache(r0)))
            await c.add(c.node(DecodeRole, "decode-0", ecfg=ecfg, engine=own_cache(r1)))
            req = c.request(f"g-{mode}", ids, greedy)
            run = asyncio.create_task(c.gw.service.run(req))
            assert await outcome(req, 60) == Done("length")
            await run
            assert (req.ran_on["prefill"] == "decode-0") == (mode == "always")
            outputs.append(req.output_ids)
    assert outputs[0] == outputs[1] == expected[0].token_ids
