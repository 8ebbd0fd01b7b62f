"""SIGTERM and a live role switch, in either order: a real signal to this process at each
moment of a switch (the old role draining for it, the old role shutting down, the new one
starting) ends in a drain and the serving loop's return (`pdserve prefill|decode` exits 0),
never in the new role serving on or registering; a second signal stops at once; a switch
ordered while the node drains starts no new role."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdserve.common.engine.sim import SimEngine
from pdserve.common.node.kv import NodeKv
from pdserve.common.node.links import GatewayLink
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Register
from pdserve.common.wire.transport import free_port
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_role_switch import Swing, _role
from tests.component.cluster import SIM, Cluster, outcome, prompt, until

REAL_TIME = dataclasses.replace(SIM, sim_time_scale=1.0)  # a stream decodes for seconds


def _sigterm() -> None:
    """A real SIGTERM to this process, as a pod's stop sends one; the node's handler must be
    installed (the default action would end the test run instead)."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
    signal.raise_signal(signal.SIGTERM)


@contextlib.asynccontextmanager
async def _swing(tokenizer: Any, **cfg: Any) -> AsyncIterator[tuple[Cluster, Swing]]:
    """A prefill node and a decode node "swing" served as `pdserve decode` serves one (its
    sequences decode on through a drain: nothing moves them)."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        swing = Swing(c, "swing", "decode", REAL_TIME, SimEngine(REAL_TIME),
                      drain_migrate="off", **cfg)  # fmt: skip
        try:
            await until(lambda: _role(c, "swing") == "decode", 30, "swing registers")
            yield c, swing
        finally:
            if not swing.task.done():
                await swing.stop()


async def _streaming(c: Cluster, swing: Swing, max_tokens: int) -> Any:
    """A stream decoding on swing (its wire id there: `req.wire_id` changes once re-placed)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = c.request("r", prompt(64), params)
    run = asyncio.create_task(c.gw.service.run(req))
    await until(lambda: len(req.output_ids) >= 2, 30, "decoding on swing")
    assert req.ran_on.get("decode") == "swing"
    return req, req.wire_id, run


async def test_a_sigterm_as_the_old_role_shuts_down_for_a_switch_ends_the_process(tokenizer):
    async with _swing(tokenizer) as (c, swing):
        old = swing.nodes[0]
        shutdown = old.shutdown

        async def signalled() -> None:  # drained for the switch, the old role ends
            _sigterm()
            await shutdown()

        old.shutdown = signalled  # type: ignore[method-assign]
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await asyncio.wait_for(swing.task, 10)  # returned: the process exits 0
        assert len(swing.nodes) == 1  # no new role


@pytest.mark.parametrize("first_await", ["data listener", "metrics server"])
async def test_a_sigterm_as_the_new_role_starts_drains_it_unregistered(
    tokenizer, monkeypatch, first_await
):
    """The old role is gone and the new one is built when the signal comes; it is handled
    at the new role's first await as it starts: its data plane's (a listener that takes a
    moment to open, here made to), or its metrics server's start. The old role's handler,
    still installed while the new role's data plane started, took it for a signal during its
    switch, which was over: lost, the new role served on until a pod's grace ran out. One
    handled as the metrics server started drained the new role, but it registered first."""
    cfg = {"metrics_port": free_port()} if first_await == "metrics server" else {}
    async with _swing(tokenizer, **cfg) as (c, swing):
        if first_await == "data listener":
            start = NodeKv.start

            async def opening(kv: NodeKv) -> list[asyncio.Task]:
                # a timer's end is handled after the I/O of its loop turn: the signal first
                await asyncio.sleep(0.001)
                return await start(kv)

            monkeypatch.setattr(NodeKv, "start", opening)
        sent: list[tuple[GatewayLink, object]] = []
        send = GatewayLink.send

        async def recorded(link: GatewayLink, msg: Any) -> None:
            sent.append((link, msg))
            await send(link, msg)

        monkeypatch.setattr(GatewayLink, "send", recorded)
        swing.on_make = lambda role: _sigterm()
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await asyncio.wait_for(swing.task, 10)  # returned: the process exits 0
        old, new = swing.nodes
        assert (old.role.role, new.role.role) == ("decode", "prefill") and new.draining
        registers = [m for link, m in sent if link in new.control.links and isinstance(m, Register)]
        assert not registers  # it never offered itself as a prefill node


async def test_a_sigterm_while_draining_for_a_switch_finishes_the_drain_and_ends(tokenizer):
    async with _swing(tokenizer) as (c, swing):
        req, rid, run = await _streaming(c, swing, 60)
        old = swing.nodes[0]
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await until(lambda: old.control.switch_to == "prefill", what="the switch's drain")
        assert old.draining and rid in old.requests
        _sigterm()
        assert await outcome(req, 30) == Done("length")  # the held stream ran to its end
        await asyncio.wait_for(swing.task, 10)
        assert len(swing.nodes) == 1  # no new role
        await run


async def test_a_second_sigterm_in_a_switch_s_drain_stops_at_once(tokenizer):
    async with _swing(tokenizer) as (c, swing):
        req, rid, run = await _streaming(c, swing, 3000)  # decoding for many seconds
        old = swing.nodes[0]
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await until(lambda: old.control.switch_to == "prefill", what="the switch's drain")
        _sigterm()
        _sigterm()
        await asyncio.wait_for(swing.task, 10)
        assert len(swing.nodes) == 1 and rid in old.requests  # stopped, not drained
        c.gw.service.abort(req)
        run.cancel()


async def test_a_switch_ordered_while_the_node_drains_starts_no_new_role(tokenizer):
    async with _swing(tokenizer) as (c, swing):
        req, _, run = await _streaming(c, swing, 3000)
        old = swing.nodes[0]
        handled: list[object] = []
        dispatch = old.control._dispatch

        async def recording(link: Any, msg: Any) -> None:
            await dispatch(link, msg)
            handled.append(msg)

        old.control._dispatch = recording  # type: ignore[method-assign]
        _sigterm()
        await until(lambda: c.gw.cluster.nodes["swing"].load.draining, what="seen draining")
        assert await c.gw.pools.switch_role("swing", "prefill", "test")
        await until(lambda: any(type(m).__name__ == "SwitchRole" for m in handled), what="read")
        assert old.control.switch_to is None
        c.gw.service.abort(req)  # the client leaves: nothing held, the drain is over
        await asyncio.wait_for(swing.task, 10)
        assert len(swing.nodes) == 1
        run.cancel()
