"""Messages in good form from a peer that is no registered node, or naming what is not its
own, change nothing at the gateway: no live node dropped, no node's capacity blanked, no
metric series invented, no token outside the vocabulary in a stream."""

from __future__ import annotations

import asyncio

import msgspec

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import (
    GATEWAY_DECODER,
    KvTransferred,
    NeedDecode,
    Redirect,
    Register,
    RegisterRefuse,
    TokenBatch,
    encode,
)
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.component.cluster import TIMEOUT, Cluster, outcome, prompt, until

SLOW = EngineConfig(engine="sim", sim_time_scale=1.0, num_kv_blocks=256)


async def test_control_and_token_messages_from_a_rogue_peer_change_nothing(tokenizer):
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=SLOW))
        ctx = c.gw.link.ctx
        rogue = make_socket(ctx, "node.control", c.address, identity="rogue/1")
        tokens = make_socket(ctx, "decode.tokens", f"tcp://127.0.0.1:{c.gw.cfg.tokens_port}")
        live = c.gw.cluster.nodes["prefill-0"].identity
        try:
            # the live prefill node's id in the other role from another socket (what a role
            # switch looks like), but a node that could not join: it used to drop the live one
            fake = msgspec.structs.replace(prefill.info(), role="decode",
                                           tokenizer_fingerprint="another")  # fmt: skip
            await rogue.send(encode(Register(info=fake)))
            assert isinstance(GATEWAY_DECODER.decode(await rogue.recv()), RegisterRefuse)
            assert c.gw.cluster.nodes["prefill-0"].identity == live
            # a KV refusal naming the decode node, for no request of the sender's: it used to
            # mark the decode node's report stale (no placement on it until its next beat)
            await rogue.send(encode(NeedDecode(request_id="x", refused_by="decode-0",
                                               reason="full")))  # fmt: skip
            assert GATEWAY_DECODER.decode(await rogue.recv()) == Redirect(request_id="x",
                                                                          decode=None)  # fmt: skip
            assert c.gw.cluster.nodes["decode-0"].refused_at < 0
            # transfer records with invented backends: a series each, before
            counted = c.gw.metrics.node_messages.labels("KvTransferred")
            seen = counted._value.get()
            for i in range(40):
                record = KvTransferred(request_id="x", backend=f"b{i}", bytes=1, layerwise=False,
                                       start_ms=0, end_ms=1)  # fmt: skip
                await rogue.send(encode(record))
            await until(lambda: counted._value.get() >= seen + 40, what="the records read")
            assert 'backend="b' not in c.gw.metrics.render().decode()
            # a token id past the vocabulary, for a stream being decoded, from its decode
            # node's name: it reached the detokenizer (OverflowError) and the stream's text
            params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
            req = c.request("r0", prompt(30, 3000), params)
            run = asyncio.create_task(c.gw.service.run(req))
            await until(lambda: len(req.output_ids) >= 3, what="decoding")
            wire_id = next(a.wire_id for a in c.gw.table.attempts.values() if a.req is req)
            ahead = len(req.output_ids) + 5  # held back till its place: then it wins over
            await tokens.send(encode(TokenBatch(node_id="decode-0", request_ids=[wire_id],
                                                token_ids=[2**40], indices=[ahead],
                                                finish_reasons=[None])))  # fmt: skip
            assert await outcome(req, TIMEOUT * 3) == Done("length")
            await run
            assert req.output_ids == _sim_ids(req.prompt_ids, 3, 40)
        finally:
            rogue.close()
            tokens.close()


async def test_a_failing_liveness_tick_is_logged_and_the_next_one_runs(tokenizer):
    """Any exception in a tick (pool care, say) ended the liveness loop silently: no node
    ever expired again and /health kept listing dead nodes."""
    async with Cluster(tokenizer) as c:
        ticks = 0

        async def failing(now: float, awake: float) -> None:
            nonlocal ticks
            ticks += 1
            raise RuntimeError("a pool-care bug")

        c.gw.pools.tick = failing  # type: ignore[method-assign]
        await until(lambda: ticks >= 3, what="three ticks, each failing")
        assert not any(t.done() for t in c.gw.tasks)
