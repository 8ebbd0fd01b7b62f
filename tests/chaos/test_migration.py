"""Live KV migration: a decode node that drains moves its running sequences, KV and all, to
another decode node, and each stream goes on under the same wire id: no recompute (one
attempt per request), no token lost or repeated, the same tokens as an undisturbed run (sim
ids, and greedy SmolLM2 text against the single-process engine)."""

from __future__ import annotations

import asyncio

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import FirstToken, Migrate, Msg
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.component.cluster import Cluster, outcome, own_cache, prompt, until
from tests.component.test_migration_races import reads
from tests.conftest import make_engine

STEADY = EngineConfig(engine="sim", sim_time_scale=1.0, num_kv_blocks=2048)


def _idle(node) -> bool:
    return not node.requests and node.blocks.num_in_use_blocks == 0


async def test_a_draining_decode_node_moves_its_sequences_with_their_kv(tokenizer):
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=STEADY))
        d0 = await c.add(c.node(DecodeRole, "decode-0", ecfg=STEADY))
        d1 = await c.add(c.node(DecodeRole, "decode-1", ecfg=STEADY))
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=9, ignore_eos=True)
        reqs = [c.request(f"m{i}", prompt(40 + i, 3000 + 100 * i), params) for i in range(16)]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        await until(lambda: sum(len(r.output_ids) >= 10 for r in reqs) == 16, 20, "decoding")
        moving = {rid for rid in d0.requests} | {rid for rid in d1.requests}
        source = d0 if len(d0.requests) >= len(d1.requests) else d1
        target = d1 if source is d0 else d0
        on_source = set(source.requests)
        assert on_source and moving
        source.control.begin_drain()
        results = [await outcome(r, 30) for r in reqs]
        await asyncio.gather(*runs)
        assert results == [Done("length")] * 16
        for r in reqs:
            assert r.output_ids == _sim_ids(r.prompt_ids, 9, 120), r.request_id
            assert r.attempt == 0 and not r.losses, r.request_id  # never recomputed
        moved = {r.request_id for r in reqs if r.ran_on["decode"] == target.node_id}
        assert {rid.split(".")[0] for rid in on_source} <= moved
        assert c.gw.metrics.migrations.labels("moved")._value.get() == len(on_source)
        assert source.metrics.migrations._value.get() == len(on_source)
        await until(source.stopped.is_set, 10, "the drained node exits")
        assert _idle(source)
        await until(lambda: _idle(target), 10, "the target freed every block")
        assert not c.gw.table


async def test_greedy_text_is_unchanged_by_a_migration_mid_stream(tokenizer, torch_runners):
    ecfg, r0, r1, r2 = torch_runners
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = "Explain why the sky is blue, step by step, for a curious child."
    ids = tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    expected = make_engine(own_cache(r0), tokenizer, prefix_caching="off").generate([ids], greedy)[
        0
    ]
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=r0))
        d0 = await c.add(c.node(DecodeRole, "decode-0", ecfg=ecfg, engine=r1))
        d1 = await c.add(c.node(DecodeRole, "decode-1", ecfg=ecfg, engine=r2))
        req = c.request("g", ids, greedy)
        run = asyncio.create_task(c.gw.service.run(req))
        await until(lambda: len(req.output_ids) >= 12, 60, "decoding")
        source = d0 if req.ran_on["decode"] == "decode-0" else d1
        source.control.begin_drain()
        assert await outcome(req, 60) == Done("length")
        await run
        assert req.output_ids == expected.token_ids  # the same greedy text, token for token
        assert req.attempt == 0 and req.ran_on["decode"] != source.node_id
        await until(source.stopped.is_set, 10, "the drained node exits")


async def test_with_no_other_decode_node_the_draining_one_finishes_its_sequences(tokenizer):
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=STEADY))
        only = await c.add(c.node(DecodeRole, "decode-0", ecfg=STEADY))
        params = SamplingParams(max_tokens=80, temperature=1.0, seed=4, ignore_eos=True)
        reqs = [c.request(f"s{i}", prompt(30, 5000 + 100 * i), params) for i in range(4)]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        await until(lambda: all(len(r.output_ids) >= 5 for r in reqs), 20, "decoding")
        only.control.begin_drain()
        assert [await outcome(r, 30) for r in reqs] == [Done("length")] * 4
        await asyncio.gather(*runs)
        for r in reqs:  # finished where they were: no recompute, exact tokens
            assert r.output_ids == _sim_ids(r.prompt_ids, 4, 80) and r.attempt == 0
        assert c.gw.metrics.migrations.labels("stayed")._value.get() == 4
        await until(only.stopped.is_set, 10, "the drained node exits once idle")


class _SlowPipe:
    """A prefill node's messages to the gateway, from its first FirstToken on, held (in
    order) until `release`: that token late on its pipe, the KV already at its decode node."""

    def __init__(self, node) -> None:
        self.send, self.held, self.open = node.send_gateway, [], False
        node.send_gateway = self

    async def __call__(self, msg: Msg) -> None:
        if not self.open and (self.held or isinstance(msg, FirstToken)):
            self.held.append(msg)
            return
        await self.send(msg)

    async def release(self) -> None:
        while self.held:
            await self.send(self.held.pop(0))
        self.open = True


async def test_a_sequence_asked_to_move_before_its_first_token_is_read_moves(
    tokenizer, monkeypatch
):
    """The decode node drains with a sequence whose first token the gateway has not read
    yet (the prefill node's FirstToken late on its own pipe): its Migrate was answered
    "stay" and never asked again, so it was decoded there to its end (or handed back at
    --drain-timeout and recomputed). It moves once that token is read, token for token."""
    migrates = reads(monkeypatch, Migrate)
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0", ecfg=STEADY))
        pipe = _SlowPipe(prefill)
        d0 = await c.add(c.node(DecodeRole, "decode-0", ecfg=STEADY))
        d1 = await c.add(c.node(DecodeRole, "decode-1", ecfg=STEADY))
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=9, ignore_eos=True)
        req = c.request("f", prompt(40, 7000), params)
        run = asyncio.create_task(c.gw.service.run(req))
        await until(lambda: "f.0" in d0.requests or "f.0" in d1.requests, what="the KV landed")
        source, target = (d0, d1) if "f.0" in d0.requests else (d1, d0)
        source.control.begin_drain()
        await until(lambda: bool(migrates), what="the gateway read the drain's Migrate")
        await pipe.release()
        assert await outcome(req, 30) == Done("length")
        await run
        assert req.output_ids == _sim_ids(req.prompt_ids, 9, 120)  # no token lost or repeated
        assert req.attempt == 0 and not req.losses  # never recomputed
        assert req.ran_on["decode"] == target.node_id
        assert c.gw.metrics.migrations.labels("moved")._value.get() == 1
        await until(source.stopped.is_set, 10, "the drained node exits")
        assert _idle(source)
        await until(lambda: _idle(target) and _idle(prefill), 10, "every block freed")
        assert not c.gw.table
