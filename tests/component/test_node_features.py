"""A gateway asks a node only what the node's version reads (`NodeInfo.features`): a
resumable stream ended at the gateway by a stop string is kept there as ended
(`Release(tokens)`) on a node that reads it, and aborted, as before that field, on a node of
an older version, which would read it as a plain `Release` and decode the stream on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Delta, Done, Failed, GatewayRequest
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, prompt, until
from tests.e2e.streams import sim_text, stopped_half_way

# 400 tokens at 0.05 x a modelled step: the stop half way is matched while the node decodes
SLOW = EngineConfig(engine="sim", sim_time_scale=0.05, num_kv_blocks=4096)


@pytest.mark.parametrize("reads", [True, False], ids=["reads-release-tokens", "older-node"])
async def test_a_stream_stopped_at_the_gateway_is_kept_only_where_the_node_reads_it(
    tokenizer, reads
):
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=SLOW))
        d = c.node(DecodeRole, "decode-0", ecfg=SLOW)
        if not reads:  # a node of the version before the field: it says nothing of it
            info = d.info()
            d.info = lambda: msgspec.structs.replace(info, features=())
        await c.add(d)
        ids = prompt(40)
        text, stop = stopped_half_way(sim_text(tokenizer, ids, 8, 400))
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=8, ignore_eos=True,
                                stop=tuple(stop))  # fmt: skip
        req = c.request("s0", ids, params)
        req.resumable = True
        run = asyncio.create_task(c.gw.service.run(req))
        assert await asyncio.wait_for(_read(req), 30) == (text, Done("stop"))
        await run
        kept = d.control.adoption.finished
        # either way the node holds no running stream and no KV for it soon after
        await until(lambda: not d.requests and d.blocks.num_in_use_blocks == 0, 10,
                    "the stopped stream to end on its node")  # fmt: skip
        if reads:  # kept as ended at the gateway's count, for a resume
            assert list(kept) == [req.wire_id]
            assert len(kept[req.wire_id][0].seq.output_ids) == len(req.output_ids)
        else:  # aborted: nothing kept, nothing decoded on
            assert not kept


async def _read(req: GatewayRequest) -> tuple[str, Done | Failed]:
    parts = []
    while not isinstance(event := await req.events.get(), Done | Failed):
        if isinstance(event, Delta):
            parts.append(event.text)
    return "".join(parts), event


async def test_a_role_switch_fits_the_model_s_own_context_limit_to_the_new_role(tokenizer):
    """Each role fits the engine's context limit to its cache (a decode node keeps a
    watermark free, a prefill node none); the shared engine kept the last role's fit, so a
    node switched decode -> prefill kept the decode role's smaller limit and ended
    requests as "length" early."""
    from pdserve.common.engine.sim import SimEngine
    from tests.component.cluster import SIM

    engine = SimEngine(SIM)
    own = engine.max_model_len
    async with Cluster(tokenizer) as c:
        decode = c.node(DecodeRole, "swing", engine=engine)
        as_decode = engine.max_model_len
        assert as_decode == min(own, decode.scheduler.largest_prompt) < own
        prefill = c.node(PrefillRole, "swing", engine=engine)
        assert engine.max_model_len == min(own, prefill.scheduler.largest_prompt) > as_decode
        again = c.node(DecodeRole, "swing", engine=engine)
        assert engine.max_model_len == as_decode
        for node in (decode, prefill, again):  # never started: their sockets and threads
            await node.shutdown()
