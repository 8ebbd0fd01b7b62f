"""A gateway that cannot run for longer than the heartbeat timeout (CPU starvation on a
small box, a long GC or swap pause, a container throttled by its CPU quota) must not take
the silence for its nodes' death: their heartbeats waited unread in its own socket. Had it
dropped them, every request in flight would be re-placed or failed. SIGSTOP freezes the
gateway for twice the heartbeat timeout while streams run; every stream ends with its exact
text, nothing is re-placed and no KV block stays in use."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from pdserve.common.wire.transport import free_port
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.chaos.test_node_faults import DECODES, _running
from tests.component.cluster import SIM, Cluster, outcome, prompt
from tests.e2e.conftest import wait_for
from tests.e2e.streams import run_streams
from tests.e2e.test_faults import _blocks_in_use, _bodies, _check_texts


def test_a_frozen_gateway_keeps_its_nodes_and_every_stream(make_cluster, tokenizer):
    ports = {d: free_port() for d in DECODES}
    cluster = make_cluster(
        engine="sim",
        prefill=1,
        decode=2,
        node_flags=("--sim-time-scale", "0.2", "--kv-backend", "tcp"),
        extra={d: ("--metrics-port", str(port)) for d, port in ports.items()},
    )
    gateway = cluster.procs[0]
    bodies = _bodies(120, 40)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(run_streams(cluster.url, bodies, 60)))
    load.start()
    # frozen only once streams run on both decode nodes (their own /metrics, read the instant
    # before), not after a fixed sleep: with nothing in flight the freeze would test nothing
    running: dict[str, int] = {}

    def busy() -> bool:
        running.update({d: _running(ports[d]) for d in DECODES})
        return min(running.values()) > 0

    assert wait_for(busy, timeout=60, interval=0.01), f"no streams on both nodes: {running}"
    stalled = cluster.metric("pdserve:gateway_stall_seconds_total")
    os.kill(gateway.pid, signal.SIGSTOP)
    time.sleep(4.0)  # the heartbeat timeout is 2 s
    os.kill(gateway.pid, signal.SIGCONT)
    load.join(90)
    assert not load.is_alive()
    # the freeze, less the 0.25 s liveness tick it fell in, is counted as the gateway's own
    stalled = cluster.metric("pdserve:gateway_stall_seconds_total") - stalled
    assert stalled >= 4.0 - 0.25 - 0.05, stalled
    _check_texts(tokenizer, bodies, results)
    assert cluster.metric("pdserve:request_replacements_total") == 0
    assert all(p.poll() is None for p in cluster.procs)
    assert wait_for(lambda: _blocks_in_use(cluster) == 0, timeout=8)


async def test_a_gateway_loop_blocked_past_the_heartbeat_timeout_drops_no_node(tokenizer):
    """The harsher form, in one process: the loop the gateway and its nodes share blocks for
    1.5x the heartbeat timeout. When it runs again the liveness timer fires before the nodes'
    fresh heartbeats are read; only the gateway's own stall measurement saves the nodes."""
    async with Cluster(tokenizer, heartbeat_timeout=1.0) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=SIM))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=SIM))
        dropped: list[str] = []
        drop = c.gw.liveness.drop

        async def record(node_id: str, why: str, kind: str = "lost") -> None:
            dropped.append(f"{node_id}: {why}")
            await drop(node_id, why, kind)

        c.gw.liveness.drop = record  # type: ignore[method-assign]
        await asyncio.sleep(0.6)  # a liveness tick or two on a healthy loop
        time.sleep(1.5)  # blocks the loop: nobody runs, nothing is read
        await asyncio.sleep(0.6)
        assert not dropped
        assert c.gw.cluster.stalled_s >= 1.5 - 0.25 - 0.05  # counted, less the tick it was in
        reqs = [c.request(f"r{i}", prompt(20, 3000 + 40 * i)) for i in range(4)]
        runs = [asyncio.create_task(c.gw.service.run(r)) for r in reqs]
        results = [await outcome(r) for r in reqs]
        assert all(isinstance(o, Done) for o in results), results
        await asyncio.gather(*runs)
        assert not dropped
