"""What keeps several gateways' views of a node true at few messages: an offer placed on a
stale view is rejected with the node's truth (no broadcast of other gateways' acceptances),
and heartbeats ask for a reply only when the link's liveness needs one."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import (
    Accept,
    Reject,
)
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, outcome, prompt, until
from tests.component.test_gateways import ScriptedGateway, _node, _stop

pytestmark = pytest.mark.asyncio


async def test_an_offer_placed_on_a_stale_view_is_rejected_with_the_truth(tokenizer):
    """Nothing tells gateway B that A's request was accepted: B offers as if the node had no
    prefill work of A's (`foreign_prefill` 0) and gets "stale view" with A's prompt in
    `foreign`; offered with that belief, the node takes it (its batch has room)."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    prefill, decode = None, None
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [a, b], max_batch=4,
                              sim_time_scale=200.0)  # fmt: skip
        decode = await _node(tokenizer, DecodeRole, "decode-0", [a, b])
        p, d = prefill[0], decode[0]
        await a.offer(p, "ra.0", d, 4, tokens=40)
        await until(lambda: a.answers("ra.0"), what="A's answer")
        assert isinstance(a.answers("ra.0")[0], Accept)
        await b.offer(p, "rb.0", d, 4, tokens=24, foreign_prefill=0)
        await until(lambda: b.answers("rb.0"), what="B's answer")
        stale = b.answers("rb.0")[0]
        assert isinstance(stale, Reject) and stale.reason == "stale view", stale
        assert stale.foreign is not None and stale.foreign.prefill == (40,)
        assert stale.room > 0 and "rb.0" not in p.requests
        # the same request with the node's truth: taken; a belief above it is no refusal
        await b.offer(p, "rb.1", d, 4, tokens=24, foreign_prefill=40)
        await b.offer(p, "rb.2", d, 4, tokens=24, foreign_prefill=1000)
        await until(lambda: b.answers("rb.1") and b.answers("rb.2"), what="B's answers")
        assert isinstance(b.answers("rb.1")[0], Accept)
        assert isinstance(b.answers("rb.2")[0], Accept)
        for gw, rid in ((a, "ra.0"), (b, "rb.1"), (b, "rb.2")):
            await until(lambda g=gw, r=rid: len(g.streamed[r]) == 4, 30, f"{rid}'s stream")
        await until(lambda: not p.requests and not d.requests and not d.intake.active)
        assert d.blocks.num_in_use_blocks == 0 and p.blocks.num_in_use_blocks == 0
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await a.close()
        await b.close()


async def test_heartbeats_ask_for_a_reply_only_when_one_is_due(tokenizer):
    """A node asks a gateway for a heartbeat reply only when it has heard nothing from it
    for one and a half intervals: with a gateway that answers every asking beat, every
    second beat asks (0.1 s beats, 0.5 s timeout), and the gateway is never taken for
    silent; once it stops answering, every beat asks. An answer later than half a beat
    (0.05 s: the loop the node and the scripted gateway share, on a loaded host) makes the
    next ask a beat later."""
    a = ScriptedGateway("gw-a")
    a.asked_only = True
    beats = a.beats
    node = None
    try:
        cfg = {"heartbeat_timeout": 0.5, "heartbeat_interval": 0.1}
        node = await _node(tokenizer, DecodeRole, "decode-0", [a], node_cfg=cfg)
        link = node[0].control.links[0]
        await until(lambda: len(beats) >= 40, 10, "40 heartbeats")
        window = beats[-36:]
        asked = sum(b.reply for b in window)
        # one in two: quiet just under 0.1 s (no: the answer came just after the asking
        # beat), just under 0.2 s (asks); a late loop may make one more or one fewer ask
        assert 14 <= asked <= 24, [b.reply for b in window]
        assert link.registered and link.silent_since is None
        a.muted = True
        n = len(beats)
        await until(lambda: len(beats) >= n + 3, 10, "beats to a muted gateway")
        assert all(b.reply for b in beats[n + 1 : n + 3])
    finally:
        if node is not None:
            await _stop(node)
        await a.close()


async def test_a_dropped_node_s_labelled_series_leave_with_it(tokenizer):
    """Per-node counters (offers accepted, rejected, timed out; KV bytes) were never removed:
    every pod name ever seen stayed in /metrics (rolling updates, autoscaling)."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        metrics = c.gw.metrics
        metrics.accepts.labels("prefill-0").inc()
        metrics.offer_timeouts.labels("prefill-0").inc()
        metrics.kv_bytes.labels("prefill-0", "tcp").inc(10)
        assert 'node="prefill-0"' in metrics.render().decode()
        await c.gw.liveness.drop("prefill-0", "a test")
        assert 'node="prefill-0"' not in metrics.render().decode()


SLOW = EngineConfig(engine="sim", sim_time_scale=1.0, num_kv_blocks=256)


async def test_what_a_node_leaving_as_planned_held_does_not_count_as_a_loss(tokenizer):
    """A drain or a role switch ends with the node leaving; whatever it still held is placed
    again, but not counted against the request's --max-replacements (a request could get a
    503 for the cluster's own decisions). A node lost still counts."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        for d in ("decode-0", "decode-1"):
            await c.add(c.node(DecodeRole, d, ecfg=SLOW))
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, ignore_eos=True)
        for kind, losses in (("preempted", 0), ("lost", 1)):
            req = c.request(f"r-{kind}", prompt(30, 7000), params)
            run = asyncio.create_task(c.gw.service.run(req))
            await until(lambda r=req: len(r.output_ids) >= 5, 30, "decoding")
            await c.gw.liveness.drop(req.ran_on["decode"], "leaving", kind)
            assert await outcome(req, 60) == Done("length")
            await run
            assert req.losses == losses and req.attempt == 1
            assert c.gw.metrics.replacements.labels(kind)._value.get() == 1
