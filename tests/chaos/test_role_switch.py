"""Live role switching: a decode node becomes a prefill node in the same process, its engine
(weights and KV cache) kept, while requests stream. Its running sequences move to the other
decode node with their KV, it registers again as a prefill node and takes prompts; nothing
is lost or recomputed, and greedy SmolLM2 text equals the single-process engine's. Then the
gateway's own rule (`--role-switching on`) switches a node when the prefill pool is short."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.common.config import EngineConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.common.node.roles import serve_roles
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.launch import role_class
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_hung_engine import _sim_ids
from tests.component.cluster import Cluster, outcome, own_cache, prompt, until
from tests.conftest import make_engine

# The sim's KV at 1/1024 of the real model's (~0.5 MB a 4,000-token prompt, not the default
# 1/16's 32 MB): what these tests check is the switching rule, which reads prefill demand,
# and the texts, never the KV's size; at 1/16 copying the frames was ~1/4 of their CPU
KV_SCALE = 1 / 1024


class Swing:
    """A node served through `serve_roles`, as `pdserve prefill|decode` serves one."""

    def __init__(self, c: Cluster, node_id: str, role: str, ecfg, engine, **cfg) -> None:
        self.nodes: list = []
        self.on_make: Callable[[str], None] = lambda role: None  # the process between roles

        def make(r: str):
            self.on_make(r)
            self.nodes.append(c.node(role_class(r), node_id, ecfg=ecfg, engine=engine, **cfg))
            return self.nodes[-1]

        self.task = asyncio.create_task(serve_roles(role, make))

    async def stop(self) -> None:
        self.nodes[-1].stopped.set()
        await asyncio.wait_for(self.task, 10)


def _role(c: Cluster, node_id: str) -> str | None:
    """Its role once registered and its first load report arrived (placement sees it)."""
    node = c.gw.cluster.nodes.get(node_id)
    if node is None or not node.load.blocks_free + node.load.blocks_cached:
        return None
    return node.info.role


async def test_a_decode_node_turns_prefill_mid_stream_and_no_text_changes(tokenizer, torch_runners):
    ecfg, r0, r1, r2 = torch_runners
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = ["Why is the sky blue?", "Name three rivers.", "What is a prime number?",
             "Describe a cat.", "Count to five.", "What is rain?"]  # fmt: skip
    ids = [
        tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts
    ]
    reference = make_engine(own_cache(r0), tokenizer, prefix_caching="off")
    expected = [o.token_ids for o in reference.generate(ids, greedy)]
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=r0))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=ecfg, engine=r1))
        swing = Swing(c, "swing", "decode", ecfg, r2)
        await until(lambda: _role(c, "swing") == "decode", 30, "swing registers")
        first = [c.request(f"a{i}", ids[i], greedy) for i in range(4)]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in first]
        await until(lambda: all(len(r.output_ids) >= 4 for r in first), 60, "decoding")
        assert any(r.ran_on.get("decode") == "swing" for r in first)
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await until(lambda: _role(c, "swing") == "prefill", 60, "swing back as prefill")
        second = [c.request(f"b{i}", ids[4 + i], greedy) for i in range(2)]
        runs += [asyncio.create_task(c.gw.service.run(r)) for r in second]
        results = [await outcome(r, 120) for r in first + second]
        await asyncio.gather(*runs)
        assert results == [Done("length")] * 6
        for r, want in zip(first + second, [*expected[:4], *expected[4:]], strict=True):
            assert r.output_ids == want, r.request_id  # token for token
            assert r.attempt == 0, r.request_id  # moved with its KV, never recomputed
        assert c.gw.metrics.role_switches.labels("decode", "prefill")._value.get() == 1
        assert len(swing.nodes) == 2 and swing.nodes[0].engine is swing.nodes[1].engine
        await swing.stop()


async def test_the_gateway_switches_a_decode_node_when_prefill_is_short(tokenizer):
    """1P2D, 4,000-token prompts arriving at ~3 prefill nodes' worth: the rule moves one
    decode node to prefill, one only (the decode pool keeps one; the hold and the dwell keep
    it from flapping)."""
    real_time = EngineConfig(
        engine="sim", sim_time_scale=1.0, num_kv_blocks=8192, sim_kv_scale=KV_SCALE
    )
    async with Cluster(
        tokenizer, role_switching="on", switch_hold=0.5, switch_dwell=1.0, sizing_window=1.0
    ) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=real_time))
        swings = {n: Swing(c, n, "decode", real_time, SimEngine(real_time)) for n in ("d0", "d1")}
        await until(lambda: _role(c, "d0") == _role(c, "d1") == "decode", 30, "both register")
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True)
        reqs, runs = [], []
        loop = asyncio.get_running_loop()
        start = loop.time()

        def took_prompts() -> bool:  # a decode node switched and prefilled some
            return any(r.ran_on.get("prefill") in swings for r in reqs)

        # at least the 60 requests of 2.4 s, then on until the switch has happened and the
        # switched node took prompts, however slow this machine: a fixed-length load could end
        # first; each sent on a schedule, so a busy loop does not lower the rate
        while len(reqs) < 60 or not took_prompts():
            i = len(reqs)
            assert i < 1500, "no decode node switched to prefill and took prompts"
            req = c.request(f"p{i}", prompt(4000, 30_000 + 4001 * i), params)
            reqs.append(req)
            runs.append(asyncio.create_task(c.gw.service.run(req)))
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.04 - loop.time()))
        results = [await outcome(r, 60) for r in reqs]
        await asyncio.gather(*runs)
        assert results == [Done("length")] * len(reqs)
        for r in reqs:
            assert r.output_ids == _sim_ids(r.prompt_ids, 2, 4), r.request_id
        assert sorted([_role(c, "d0"), _role(c, "d1")]) == ["decode", "prefill"]
        assert c.gw.metrics.role_switches.labels("decode", "prefill")._value.get() == 1
        switched = "d0" if _role(c, "d0") == "prefill" else "d1"
        assert sum(r.ran_on.get("prefill") == switched for r in reqs) > 0  # it took prompts
        for swing in swings.values():
            await swing.stop()


async def test_two_gateways_that_would_both_switch_a_node_switch_one(tokenizer):
    """The same shortage seen by two gateways (every other request through each): both
    rules want a decode node moved to prefill. Only the leader (the lowest gateway id, as
    every node names it) decides: one switch in all, the other gateway orders none and
    publishes no desired-replicas signal, and the decode pool keeps a node."""
    real_time = EngineConfig(
        engine="sim", sim_time_scale=1.0, num_kv_blocks=8192, sim_kv_scale=KV_SCALE
    )
    rules = dict(role_switching="on", switch_hold=0.5, switch_dwell=1.0, sizing_window=1.0)
    async with Cluster(tokenizer, **rules) as c1, Cluster(tokenizer, **rules) as c2:
        both = f"{c1.address},{c2.address}"
        gateways = (c1, c2)
        await c1.add(c1.node(PrefillRole, "prefill-0", ecfg=real_time, gateway=both))
        swings = {
            n: Swing(c1, n, "decode", real_time, SimEngine(real_time), gateway=both)
            for n in ("d0", "d1")
        }
        for c in gateways:
            await until(lambda c=c: _role(c, "d0") == _role(c, "d1") == "decode", 30, "both")
        leader, other = sorted(gateways, key=lambda c: c.gw.link.gateway_id)
        await until(lambda: leader.gw.pools.leading() and not other.gw.pools.leading(), 10)
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True)
        reqs, runs = [], []
        loop = asyncio.get_running_loop()
        start = loop.time()

        def took_prompts() -> bool:
            return any(r.ran_on.get("prefill") in swings for r in reqs)

        while len(reqs) < 60 or not took_prompts():  # as in the one-gateway test above
            i = len(reqs)
            assert i < 1500, "no decode node switched to prefill and took prompts"
            c = gateways[i % 2]
            req = c.request(f"p{i}", prompt(4000, 30_000 + 4001 * i), params)
            reqs.append(req)
            runs.append(asyncio.create_task(c.gw.service.run(req)))
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.04 - loop.time()))
        try:
            results = [await outcome(r, 60) for r in reqs]
        except TimeoutError:  # say which request and where, for the one who debugs it
            stuck = [(r.wire_id, r.ran_on, len(r.output_ids), r.timeline) for r in reqs
                     if not r.finished]  # fmt: skip
            raise AssertionError(f"unfinished requests: {stuck}") from None
        await asyncio.gather(*runs)
        assert results == [Done("length")] * len(reqs)
        switches = [c.gw.metrics.role_switches.labels("decode", "prefill")._value.get()
                    for c in (leader, other)]  # fmt: skip
        assert switches == [1, 0]
        assert sorted([_role(leader, "d0"), _role(leader, "d1")]) == ["decode", "prefill"]
        assert leader.gw.pools.published_replicas() and not other.gw.pools.published_replicas()
        for swing in swings.values():
            await swing.stop()


def test_pdserve_processes_switch_a_role_and_rebind_their_ports(make_cluster, tokenizer):
    """The real path: `pdserve decode` processes with fixed data and metrics ports (as in
    compose); the one switched serves prefill in the same process (same pid) on the same
    ports, and every stream's text is exact."""
    import json

    from pdserve.common.wire.transport import free_port
    from tests.e2e.conftest import wait_for
    from tests.e2e.streams import SteadyLoad, sim_text

    ports = {d: (free_port(), free_port()) for d in ("decode-0", "decode-1")}
    cluster = make_cluster(
        engine="sim",
        prefill=1,
        decode=2,
        gateway_flags=("--role-switching", "on", "--switch-hold", "0.5", "--switch-dwell",
                       "1", "--sizing-window", "1"),
        node_flags=("--sim-time-scale", "1.0", "--kv-backend", "tcp", "--sim-kv-scale",
                    repr(KV_SCALE)),
        extra={d: ("--data-port", str(a), "--metrics-port", str(m)) for d, (a, m) in ports.items()},
    )  # fmt: skip
    pids = {p.pid for p in cluster.procs}

    def body(i: int) -> dict:
        return {"prompt": [1000 + (613 * i + k) % 47000 for k in range(4000)], "max_tokens": 4,
                "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True}  # fmt: skip

    # 60 requests at 25/s, now open-ended: the load runs until the gateway has switched a node,
    # however slow this machine (a fixed-length one could end before the rule fires)
    load = SteadyLoad(cluster.url, body, 0.04, 90).start()
    fired = wait_for(lambda: cluster.metric("pdserve:role_switches_total") >= 1, timeout=60)
    assert wait_for(lambda: len(load.bodies) >= 60, timeout=30)
    load.stop()
    assert load.join(), "the load generator itself hung"
    assert fired, "the gateway switched no node"
    bodies, results = load.bodies, load.results
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    for b, r in zip(bodies, results, strict=True):
        assert r.text == sim_text(tokenizer, b["prompt"], b["seed"], 4)

    def node_roles() -> dict[str, str]:
        return json.loads(cluster.get("/health")[1])["nodes"]

    # the switched node registers again, as prefill, once its sequences have moved
    wait_for(lambda: sorted(node_roles().values()) == ["decode", "prefill", "prefill"], 30)
    roles = node_roles()
    assert sorted(roles.values()) == ["decode", "prefill", "prefill"], roles
    assert cluster.metric("pdserve:role_switches_total") == 1
    switched = next(n for n in ports if roles.get(n) == "prefill")
    metrics_port = ports[switched][1]
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        assert 'role="prefill"' in resp.read().decode()  # the same port, the new role
    assert all(p.poll() is None for p in cluster.procs) and {p.pid for p in cluster.procs} == pids


async def test_a_switch_that_will_not_happen_blocks_the_next_one_no_longer(tokenizer, monkeypatch):
    """The leader switches one node at a time, and a switch was over only when the node came
    back in its new role, or after 10 minutes: a node that ignored the order (already
    draining on a SIGTERM) and exited froze role switching for 10 minutes."""
    import pdserve.gateway.pools as pools

    monkeypatch.setattr(pools, "SWITCH_GONE_S", 0.5)
    async with Cluster(tokenizer, role_switching="on", switch_hold=1e6) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        leaving = await c.add(c.node(DecodeRole, "decode-1"))
        leaving.control.begin_drain()  # a rolling update's SIGTERM, not yet reported
        assert await c.gw.pools.switch_role("decode-1", "prefill", "test")
        assert "decode-1" in c.gw.pools.switching
        await until(lambda: "decode-1" not in c.gw.cluster.nodes, 10, "it drained and left")
        await until(lambda: not c.gw.pools.switching, 10, "the switch given up")


async def test_no_switch_is_ordered_while_a_node_drains(tokenizer):
    """One switch at a time held only for the leader's own orders: a leader taking over
    from one that died mid-switch (the node draining into its new role, in no table of the
    new leader's) could order a second switch at once."""
    async with Cluster(tokenizer, role_switching="on", switch_hold=1e6) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        draining = await c.add(c.node(DecodeRole, "decode-1"))
        seen: list[bool] = []

        def decide(cluster, desired, in_prefill, switching, now):  # type: ignore[no-untyped-def]
            seen.append(switching)

        c.gw.pools.switcher.decide = decide  # type: ignore[method-assign]
        await until(lambda: len(seen) >= 2, what="pool care ticks")
        assert not any(seen)
        # it reports draining (switching roles on another leader's order, or scaled down)
        # and stays while it finishes its work: its drain itself is not what is tested here
        draining.control.draining = True
        await until(lambda: c.gw.cluster.nodes["decode-1"].load.draining, what="seen draining")
        n = len(seen)
        await until(lambda: len(seen) >= n + 2, what="two more ticks")
        assert all(seen[n:])
        draining.control.draining = False
