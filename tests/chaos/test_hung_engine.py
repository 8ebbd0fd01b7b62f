"""The progress lease: a node whose event loop still heartbeats but whose engine hangs (a
deadlocked step, a stuck device) holds its requests forever unless the gateway notices that
it produces no token while busy. With `--progress-timeout` the gateway drops such a node and
re-places its requests; each ends with the exact text a healthy node gives, and the hung node
holds nothing once it comes back."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.transport import free_port
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, outcome, prompt, until

FAST = EngineConfig(engine="sim", sim_time_scale=0.05, num_kv_blocks=256)


class HangingEngine(SimEngine):
    """A sim engine whose steps block (in the engine thread) while `hang` is set."""

    def __init__(self, ecfg: EngineConfig) -> None:
        super().__init__(ecfg)
        self.hang = threading.Event()
        self.release = threading.Event()

    def step(self, prefills, decodes, on_layer=None):  # type: ignore[no-untyped-def]
        if self.hang.is_set():
            self.release.wait(30)
        return super().step(prefills, decodes, on_layer)


@pytest.mark.parametrize("hung_role", ["prefill", "decode"])
async def test_a_node_that_heartbeats_but_produces_nothing_is_dropped_and_its_work_moves(
    tokenizer, hung_role
):
    engine = HangingEngine(FAST)
    async with Cluster(tokenizer, progress_timeout=1.0) as c:
        cls = PrefillRole if hung_role == "prefill" else DecodeRole
        hung = await c.add(c.node(cls, f"{hung_role}-0", ecfg=FAST, engine=engine))
        other = "decode" if hung_role == "prefill" else "prefill"
        other_cls = DecodeRole if hung_role == "prefill" else PrefillRole
        await c.add(c.node(other_cls, f"{other}-0", ecfg=FAST))
        spare = await c.add(c.node(cls, f"{hung_role}-1", ecfg=FAST))
        engine.hang.set()
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
        reqs = [c.request(f"r{i}", prompt(30, 2000 + 50 * i), params) for i in range(8)]
        started = time.monotonic()
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        try:
            results = [await outcome(r, 15) for r in reqs]
        finally:
            engine.release.set()  # let the engine thread end with the test
        took = time.monotonic() - started
        await asyncio.gather(*runs)
        assert results == [Done("length")] * 8
        for r in reqs:  # exactly the tokens a healthy node gives, none lost or repeated
            assert r.output_ids == _sim_ids(r.prompt_ids, 3, 12), r.request_id
        moved = [r for r in reqs if r.losses]
        assert moved, "no request was on the hung node"  # the lease did the work
        assert took < 10, took
        assert spare.node_id in {r.ran_on.get(hung_role) for r in reqs}
        # the hung node, released, registers again and frees what the gateway forgot
        await until(lambda: hung.blocks.num_in_use_blocks == 0, 10, "the hung node freed its KV")
        await until(lambda: not c.gw.table, what="every attempt closed")


def _sim_ids(prompt_ids: list[int], seed: int, n: int) -> list[int]:
    from pdserve.common.engine.sim import FIRST_ORDINARY_TOKEN, ORDINARY_TOKEN_SPAN
    from pdserve.common.sampling import counter_int

    return [
        FIRST_ORDINARY_TOKEN + counter_int(seed, len(prompt_ids) + i, ORDINARY_TOKEN_SPAN)
        for i in range(n)
    ]


async def _probe(port: int, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status, await resp.json()


async def test_a_hung_node_says_so_and_rejoins_only_once_its_engine_steps(tokenizer):
    """Dropped by the progress lease, a hung node used to register again at its next
    heartbeat (the gateway no longer knew it) and take new work into the same hung engine,
    every `--progress-timeout`, while /health said 200 and no probe could tell."""
    engine, port = HangingEngine(FAST), free_port()
    async with Cluster(tokenizer, progress_timeout=1.0) as c:
        hung = await c.add(c.node(DecodeRole, "decode-0", ecfg=FAST, engine=engine,
                                  step_timeout=0.5, metrics_port=port))  # fmt: skip
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=FAST))
        assert (await _probe(port, "/health"))[0] == 200 and (await _probe(port, "/live"))[0] == 200
        engine.hang.set()
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        req = c.request("r0", prompt(30, 2000), params)
        run = asyncio.create_task(c.gw.service.run(req))
        try:
            # hung first (its step past 0.5 s), then dropped by the lease (no token in 1 s); a
            # drop before the step hung (a slow prefill) is followed by a rejoin, then this
            await until(lambda: hung.hung() is not None, 10, "the engine step hung")
            await until(lambda: "decode-0" not in c.gw.cluster.nodes, 10, "the lease dropped it")
            for path in ("/health", "/live"):
                status, body = await _probe(port, path)
                assert status == 503 and "engine step running" in body["reason"], (path, body)
            # its heartbeats go on and are answered "unknown node": it stays out while hung
            beats = c.gw.metrics.node_messages.labels("Heartbeat")
            seen = beats._value.get()
            await until(lambda: beats._value.get() >= seen + 10, 10, "ten more heartbeats")
            assert "decode-0" not in c.gw.cluster.nodes
        except BaseException:
            run.cancel()  # a failure ends the test, not waits for the request
            raise
        finally:
            engine.release.set()
        await until(lambda: "decode-0" in c.gw.cluster.nodes, 10, "rejoined once it stepped")
        assert (await _probe(port, "/health"))[0] == 200 and (await _probe(port, "/live"))[0] == 200
        assert await outcome(req, 30) == Done("length")  # placed again, on the rejoined node
        await run
        assert req.output_ids == _sim_ids(req.prompt_ids, 5, 6)
        await until(lambda: hung.blocks.num_in_use_blocks == 0, 10, "the hung node freed its KV")
