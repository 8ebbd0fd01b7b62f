"""Shortest first on a real on-demand prefill node (sim engine, real sockets): of the prompts
it holds, a short one accepted after a long one runs in its own pass before it, instead of
sharing the long one's pass and waiting for its whole compute (common/engine/pass_order.py).
With --prefill-pass-tokens 0 (arrival order, passes up to --max-batch-tokens) they share it,
and so they do under a queueing baseline's gateway (round robin, JSQ: vLLM's order)."""

from __future__ import annotations

import pytest

from pdserve.common.wire.protocol import Accept, FirstToken
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import until
from tests.component.test_gateways import ScriptedGateway, _node, _stop

# modelled H100 time x 8: a 3,000-token pass ~0.77 s (the time the test has to offer two
# prompts while it runs, a few ms on a quiet host), 2,000 tokens ~0.51 s, 64 tokens ~0.07 s
SCALE = 8.0  # (prefix caching off: the scripted prompts share their first tokens)


def _first(gw: ScriptedGateway, rid: str) -> FirstToken | None:
    return next((m for m in gw.inbox if isinstance(m, FirstToken) and m.request_id == rid), None)


@pytest.mark.parametrize(("pass_tokens", "queueing"), [(1024, False), (0, False), (1024, True)])
async def test_a_short_prompt_does_not_wait_for_a_long_ones_compute(
    tokenizer, pass_tokens, queueing
):
    gw = ScriptedGateway("gw")
    gw.queueing = queueing
    prefill, decode = None, None
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [gw], max_batch=4,
                              sim_time_scale=SCALE, prefill_pass_tokens=pass_tokens,
                              num_kv_blocks=1024, prefix_caching="off")  # fmt: skip
        decode = await _node(tokenizer, DecodeRole, "decode-0", [gw], sim_time_scale=SCALE,
                             num_kv_blocks=1024)  # fmt: skip
        p, d = prefill[0], decode[0]
        await gw.offer(p, "first", d, 2, tokens=3000)
        await until(lambda: "first" in p.steps.in_step, what="the first pass running")
        # both arrive during that pass: the long one first
        await gw.offer(p, "long", d, 2, tokens=2000)
        await gw.offer(p, "short", d, 2, tokens=64)
        await until(lambda: gw.answers("long") and gw.answers("short"), what="answers")
        assert isinstance(gw.answers("long")[0], Accept)
        assert isinstance(gw.answers("short")[0], Accept)
        assert "first" in p.steps.in_step  # both wait for the next pass
        await until(lambda: _first(gw, "long") is not None, what="the long prompt's token")
        await until(lambda: _first(gw, "short") is not None, what="the short prompt's token")
        long, short = _first(gw, "long"), _first(gw, "short")
        assert long is not None and short is not None
        order = [m.request_id for m in gw.inbox if isinstance(m, FirstToken)]
        if pass_tokens and not queueing:
            assert order.index("short") < order.index("long")
            # its own pass: a 64-token pass is ~1/8 of the 2,000-token one in the model
            assert short.prefill_ms < long.prefill_ms / 3, (short, long)
        else:  # one pass for both: the short one's compute time is the long one's
            assert abs(short.prefill_ms - long.prefill_ms) < long.prefill_ms / 10, (short, long)
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await gw.close()
