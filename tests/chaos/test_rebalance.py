"""Rebalancing the decode pool (`--rebalance`): sequences placed on one decode node outgrow
its cache (placement sees only prompts), while a second decode node joins empty. Without
rebalancing the full node preempts, and the preempted requests are recomputed elsewhere;
with it, the gateway moves running sequences with their KV to the empty node first: no
request is recomputed, every token is the undisturbed run's, and both nodes end idle."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.chaos.test_migration import _idle
from tests.component.cluster import Cluster, outcome, prompt, until

# 64 blocks of 16 tokens; 7 requests growing to 10 blocks each need 70: one node cannot hold
# them all to the end
SMALL = EngineConfig(engine="sim", sim_time_scale=2.0, num_kv_blocks=64)
ROOMY = EngineConfig(engine="sim", sim_time_scale=2.0, num_kv_blocks=2048)


@pytest.mark.parametrize("share", [0.0, 0.5], ids=["off", "on"])
async def test_a_filling_decode_node_hands_sequences_to_an_empty_one(tokenizer, share):
    async with Cluster(tokenizer, rebalance=share) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=ROOMY))
        full = await c.add(c.node(DecodeRole, "decode-0", ecfg=SMALL))
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=6, ignore_eos=True)
        reqs = [c.request(f"b{i}", prompt(40, 7000 + 100 * i), params) for i in range(7)]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        await until(lambda: all(len(r.output_ids) >= 2 for r in reqs), 20, "all decoding")
        assert all(r.ran_on["decode"] == "decode-0" for r in reqs)
        empty = await c.add(c.node(DecodeRole, "decode-1", ecfg=SMALL))
        results = [await outcome(r, 60) for r in reqs]
        await asyncio.gather(*runs)
        assert results == [Done("length")] * 7
        for r in reqs:  # moved or recomputed, the tokens are the undisturbed run's
            assert r.output_ids == _sim_ids(r.prompt_ids, 6, 120), r.request_id
        recomputed = [r.request_id for r in reqs if r.attempt > 0]
        asked = c.gw.metrics.rebalances._value.get()
        moved = c.gw.metrics.migrations.labels("moved")._value.get()
        if share:
            assert not recomputed and asked > 0 and moved > 0, (recomputed, asked, moved)
            assert any(r.ran_on["decode"] == "decode-1" for r in reqs)
        else:  # the case the rule exists for did occur
            assert recomputed and asked == 0, (recomputed, asked)
        await until(lambda: _idle(full) and _idle(empty), 10, "every block freed")
        assert not c.gw.table
