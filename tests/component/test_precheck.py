"""A node asks the gateways whether they would take it before its weights load
(common/node/precheck.py, `Probe`): a refusal comes while it loads, an answer that it fits
or no answer at all leaves the decision to `Register`, and asking registers nothing. The
whole process (refused before its load, exit code 78, EXIT_REFUSED) runs in
tests/e2e/test_correctness.py's 4-bit test."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import msgspec
import zmq.asyncio

from pdserve.common.config import NodeConfig
from pdserve.common.node import precheck
from pdserve.common.wire.protocol import Load, Probe
from pdserve.common.wire.security import ClusterKey
from pdserve.common.wire.transport import free_port, make_socket
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster


def probe_like(node, **changed: str) -> Probe:
    """What a node of `node`'s model and numerics would ask, with `changed` fields."""
    info = node.info()
    fields = {name: getattr(info, name)
              for name in ("model_id", "dtype", "tokenizer_fingerprint", "kv_layout")}  # fmt: skip
    return Probe(node_id="newcomer", **{**fields, **changed})


def never() -> Future:
    return Future()  # a load that does not end: only the answers (or `wait`) end the asking


async def test_a_probe_is_refused_where_register_would_be_and_registers_nothing(tokenizer):
    async with Cluster(tokenizer) as c:
        cfg = NodeConfig(gateway=c.address)
        first = c.node(PrefillRole, "prefill-0")
        empty = probe_like(first, dtype="float32+int4")
        # no node yet: the first to register sets what the cluster runs
        assert await precheck.ask(cfg, None, empty, never(), wait=10) is None
        await c.add(first)
        odd = {"dtype": "float32+int4", "model_id": "other", "kv_layout": "0123456789ab",
               "tokenizer_fingerprint": "x"}  # fmt: skip
        for name, value in odd.items():
            started = time.monotonic()
            reason = await precheck.ask(
                cfg, None, probe_like(first, **{name: value}), never(), wait=10
            )
            assert reason is not None and c.address in reason, (name, reason)
            assert "tokenizes differently" in reason if name.startswith("tok") else name in reason
            assert time.monotonic() - started < 5  # answered, not the wait run out
        started = time.monotonic()
        assert await precheck.ask(cfg, None, probe_like(first), never(), wait=10) is None
        assert time.monotonic() - started < 5
        assert set(c.gw.cluster.nodes) == {"prefill-0"}  # a probe is no registration
        assert c.gw.cluster.reference == first.info()


async def test_one_refusing_gateway_of_two_is_enough_and_a_silent_one_waits_for_the_load(
    tokenizer,
):
    """A gateway that never answers (a socket nobody reads: not up yet, or an older version
    dropping the message) holds the node up only until its weights are loaded."""
    ctx = zmq.asyncio.Context()
    silent = f"tcp://127.0.0.1:{free_port()}"
    sock = make_socket(ctx, "gateway.control", silent)
    try:
        async with Cluster(tokenizer) as c:
            first = await c.add(c.node(PrefillRole, "prefill-0"))
            both = NodeConfig(gateway=f"{silent},{c.address}")
            odd = probe_like(first, dtype="bfloat16")
            reason = await precheck.ask(both, None, odd, never(), wait=10)
            assert reason is not None and "dtype" in reason and c.address in reason
            loading: Future[None] = Future()
            asyncio.get_running_loop().call_later(0.3, loading.set_result, None)
            started = time.monotonic()
            assert await precheck.ask(both, None, probe_like(first), loading, wait=10) is None
            assert 0.3 <= time.monotonic() - started < 5  # the load's end, not the wait
            started = time.monotonic()
            alone = NodeConfig(gateway=silent)  # and `wait` bounds it when the load is long
            assert await precheck.ask(alone, None, odd, never(), wait=0.5) is None
            assert 0.5 <= time.monotonic() - started < 5
    finally:
        sock.close()
        ctx.term()


async def test_a_probe_the_gateway_cannot_read_is_dropped_and_it_serves_on(tokenizer):
    async with Cluster(tokenizer) as c:
        first = await c.add(c.node(PrefillRole, "prefill-0"))
        ctx = zmq.asyncio.Context()
        sock = make_socket(ctx, "node.control", c.address, identity="garbage")
        try:
            bad = msgspec.msgpack.encode({"type": "Probe", "node_id": 7, "dtype": ["x"]})
            await sock.send(bad)
            probe = probe_like(first, dtype="bfloat16")
            assert await precheck.ask(NodeConfig(gateway=c.address), None, probe, never(), 10)
            assert set(c.gw.cluster.nodes) == {"prefill-0"}  # and the loop answered the next
        finally:
            sock.close()
            ctx.term()


async def test_a_keyed_gateway_answers_a_probe_with_the_key_only(tokenizer, tmp_path):
    key_file = tmp_path / "cluster.key"
    ClusterKey.generate().save(key_file)
    key = ClusterKey.load(key_file)
    async with Cluster(tokenizer, cluster_key=str(key_file)) as c:
        first = await c.add(c.node(PrefillRole, "prefill-0", cluster_key=str(key_file)))
        cfg, odd = NodeConfig(gateway=c.address), probe_like(first, dtype="bfloat16")
        started = time.monotonic()
        reason = await precheck.ask(cfg, key, odd, never(), wait=10)
        assert reason is not None and "dtype" in reason and time.monotonic() - started < 5
        # a peer without the key learns nothing (the handshake fails): Register decides
        assert await precheck.ask(cfg, None, odd, never(), wait=0.5) is None
        assert await precheck.ask(cfg, ClusterKey.generate(), odd, never(), wait=0.5) is None


def test_a_probe_is_not_held_to_what_a_leaving_cluster_runs(tokenizer):
    """A rollout to another model: while every node of the old one drains or has gone
    silent (half its lease), a probe fits; Register, after the load, still applies the
    rule, and a live node of the old model refuses the probe as before."""
    from pdserve.gateway.cluster import ClusterView
    from tests.component.test_wire import INFO  # a NodeInfo as a node sends it

    view = ClusterView(heartbeat_timeout=2.0)
    fp = INFO.tokenizer_fingerprint
    assert view.register(INFO, b"old", now=100.0, gateway_tokenizer=fp) is None
    other = Probe(node_id="new", model_id="another-model", dtype=INFO.dtype,
                  tokenizer_fingerprint=fp, kv_layout=INFO.kv_layout)  # fmt: skip
    assert "model_id" in (view.refusal(other, fp, probed_at=100.5) or "")
    assert view.refusal(other, fp, probed_at=101.5) is None  # silent for 1.5 s of a 2 s lease
    assert "model_id" in (view.refusal(other, fp) or "")  # Register's check: no exception
    view.heartbeat(INFO.node_id, b"old", Load(running=1, waiting=0, blocks_free=0,
                   blocks_cached=0, blocks_in_use=1, draining=True), now=101.5)  # fmt: skip
    assert view.refusal(other, fp, probed_at=101.6) is None  # draining
