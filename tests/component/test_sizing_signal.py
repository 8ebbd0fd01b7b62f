"""The autoscaling signal under a load step: `pdserve:desired_replicas{pool="prefill"}` is
1 while one prefill node keeps up, rises while 4,000-token prompts arrive faster than three
nodes' worth of prefill, and falls back to 1 within a few windows once the step ends."""

from __future__ import annotations

import asyncio
import re

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, outcome, prompt, until

REAL_TIME = EngineConfig(engine="sim", sim_time_scale=1.0, num_kv_blocks=8192)


def _desired(c: Cluster, pool: str) -> int:
    """The exported signal; 0 while there is none (decided on the liveness tick, from a view
    of every node's report: gateway/pools.py)."""
    text = c.gw.metrics.render().decode()
    found = re.search(rf'^pdserve:desired_replicas{{pool="{pool}"}} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


async def test_desired_prefill_replicas_follow_a_load_step(tokenizer):
    async with Cluster(tokenizer, sizing_window=1.0) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=REAL_TIME))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=REAL_TIME))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await until(lambda: _desired(c, "prefill") == 1 and _desired(c, "decode") == 1, 5,
                    "the signal for an idle cluster")  # fmt: skip
        # the step: a 4,000-token prompt every 40 ms for 2 s; each takes ~130 ms to prefill
        # (H100 x Llama-3.1-8B, the sim engine in real time): ~3.3 nodes' worth
        reqs, runs, peak = [], [], 1
        for i in range(50):
            req = c.request(f"s{i}", prompt(4000, 20_000 + 4001 * i), params)
            reqs.append(req)
            runs.append(asyncio.create_task(c.gw.service.run(req)))
            await asyncio.sleep(0.04)
            peak = max(peak, _desired(c, "prefill"))
        assert peak >= 4, peak  # the offered work over 0.8, plus the backlog waiting
        for r in reqs:
            await outcome(r, 60)
        await asyncio.gather(*runs)
        # no more arrivals: the weighted rate decays (e^-1 a window), the signal with it
        await until(lambda: _desired(c, "prefill") == 1, 10, "the signal falls back")
