"""The `pdserve up` supervisor's policy, on a clock passed in: restart with backoff, give up
after repeated fast failures, never restart a clean exit, stop only without the gateway."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.supervisor import Child, Supervisor


class FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def kill(self) -> None:
        self.code = -9 if self.code is None else self.code


def make(*names: str, **kw: Any) -> tuple[Supervisor, dict[str, list[FakeProc]]]:
    spawned: dict[str, list[FakeProc]] = {n: [] for n in names}

    def spawn(child: Child) -> Any:
        proc = FakeProc()
        spawned[child.name].append(proc)
        return proc

    phases = {"prefill": ("prefill",), "decode": ("decode",), "colocated": ("prefill", "decode")}
    children = [Child(n, [n], essential=(n == "gateway"), serves=phases.get(n[: n.find("-")], ()))
                for n in names]  # fmt: skip
    sup = Supervisor(children, spawn, **kw)
    sup.start(0.0)
    return sup, spawned


def test_a_killed_node_is_restarted_after_a_backoff_and_the_rest_keep_running():
    sup, spawned = make("gateway", "decode-0", "decode-1", backoff=0.5)
    spawned["decode-1"][-1].code = -9
    assert sup.step(1.0)
    assert len(spawned["decode-1"]) == 1  # waits out the backoff first
    assert sup.step(1.4) and len(spawned["decode-1"]) == 1
    assert sup.step(1.6) and len(spawned["decode-1"]) == 2
    assert len(spawned["gateway"]) == 1 and len(spawned["decode-0"]) == 1


def test_backoff_doubles_for_fast_failures_and_resets_after_a_stable_run():
    sup, spawned = make("gateway", "prefill-0", backoff=1.0, stable_after=30.0, give_up_after=9)
    now = 0.0
    delays = []
    for _ in range(4):
        spawned["prefill-0"][-1].code = 1
        sup.step(now)
        child = sup.children[1]
        assert child.restart_at is not None
        delays.append(child.restart_at - now)
        now = child.restart_at
        sup.step(now)
    assert delays == [1.0, 2.0, 4.0, 8.0]
    spawned["prefill-0"][-1].code = 1  # this time after a long, healthy run
    sup.step(now + 100)
    assert sup.children[1].restart_at == now + 100 + 1.0


def test_repeated_fast_failures_give_up_on_that_node_only():
    sup, spawned = make("gateway", "prefill-0", "decode-0", "decode-1", backoff=0.1,
                        give_up_after=3)  # fmt: skip
    now = 0.0
    for _ in range(3):
        spawned["decode-0"][-1].code = 2
        assert sup.step(now)
        now += 1.0
        sup.step(now)
    assert sup.children[2].state == "gave_up"
    assert len(spawned["decode-0"]) == 3
    assert sup.step(now + 100)  # the gateway, the prefill node and decode-1 still serve
    assert any("giving up" in e for e in sup.events)


@pytest.mark.parametrize("lost", [("decode-0",), ("prefill-0", "colocated-0")])
def test_a_cluster_with_no_node_left_for_a_phase_stops(lost):
    """Every node that can decode (or prefill) was given up on: no request can be served,
    and the gateway would answer 503 for good while `up` ran on, exit code 0 at Ctrl-C.
    The gateway alone does not make a cluster."""
    sup, spawned = make("gateway", "prefill-0", "decode-0", "colocated-0", backoff=0.1,
                        give_up_after=2)  # fmt: skip
    now = 0.0
    for name in lost[:-1]:  # given up on first, the cluster serving on without them
        for _ in range(2):
            spawned[name][-1].code = 1
            assert sup.step(now)
            now += 1.0
            assert sup.step(now)
    if "decode-0" in lost:  # the colocated node decodes too: still served
        spawned["colocated-0"][-1].code = 0  # it drained and exited cleanly
        assert sup.step(now)
    spawned[lost[-1]][-1].code = 1
    assert sup.step(now)
    now += 1.0
    assert sup.step(now)
    spawned[lost[-1]][-1].code = 1
    assert not sup.step(now + 0.05)
    assert any("no node left that can" in e for e in sup.events)


def test_a_clean_exit_after_a_drain_is_not_a_failure():
    sup, spawned = make("gateway", "decode-0")
    spawned["decode-0"][-1].code = 0
    assert sup.step(1.0)
    assert sup.step(100.0)
    assert len(spawned["decode-0"]) == 1 and sup.children[1].state == "exited"


def test_the_gateway_is_restarted_but_a_gateway_that_cannot_run_stops_the_cluster():
    sup, spawned = make("gateway", "decode-0", backoff=0.1, give_up_after=2)
    spawned["gateway"][-1].code = -9
    assert sup.step(1.0) and sup.step(1.2)
    assert len(spawned["gateway"]) == 2
    spawned["gateway"][-1].code = 1
    assert not sup.step(1.3)  # second fast failure in a row: the cluster cannot serve


def test_a_node_refused_by_the_cluster_is_not_started_again():
    """A node refused for its numerics (EXIT_REFUSED) was restarted four times, each a
    whole model load, to be refused again, and then "gave up" on as if it had crashed."""
    from pdserve.common.errors import EXIT_REFUSED

    spawned: list[FakeProc] = []

    def spawn(child: Child) -> FakeProc:
        spawned.append(FakeProc())
        return spawned[-1]

    sup = Supervisor([Child("gateway", ["g"], essential=True), Child("decode-x", ["d"])], spawn)
    sup.start(0.0)
    spawned[1].code = EXIT_REFUSED
    for t in range(1, 40):
        assert sup.step(t)
    assert len(spawned) == 2 and sup.children[1].state == "gave_up"


def test_a_restart_that_cannot_spawn_counts_as_a_failure_not_the_cluster_s_end():
    """fork failing at a restart (EAGAIN, ENOMEM after an OOM kill) escaped `step` and took
    every process of the cluster down with `pdserve up`."""
    spawned: list[FakeProc] = []
    fail = [False]

    def spawn(child: Child) -> FakeProc:
        if fail[0] and child.name == "decode-0":
            raise OSError(11, "Resource temporarily unavailable")
        spawned.append(FakeProc())
        return spawned[-1]

    sup = Supervisor([Child("gateway", ["g"], essential=True), Child("decode-0", ["d"])], spawn,
                     backoff=1.0)  # fmt: skip
    sup.start(0.0)
    spawned[1].code, fail[0] = 1, True
    assert sup.step(1.0)  # exited: a restart is due at 2 s
    assert sup.step(2.5)  # the restart could not spawn: waiting again, the cluster on
    assert sup.children[1].state == "waiting" and sup.children[1].failures == 2


def test_a_node_that_crashes_after_each_load_is_given_up_on():
    """A node whose model load takes 45 s and that crashes soon after (OOM at its KV cache's
    allocation, say) ran "45 s" each time: past `stable_after`, so its failures reset to 1
    and it was restarted forever, a whole load each. Stability counts from when it serves
    (registered with a gateway)."""
    serving: set[str] = {"gateway"}
    sup, spawned = make("gateway", "decode-0", stable_after=30.0, give_up_after=5,
                        is_ready=lambda child: child.name in serving)  # fmt: skip
    now = 0.0
    for _ in range(5):
        sup.step(now + 1.0)  # loading: not serving
        spawned["decode-0"][-1].code = 1
        now += 45.0
        sup.step(now)  # crashed after its load
        while sup.children[1].state == "waiting":
            now += 1.0
            sup.step(now)
    assert sup.children[1].state == "gave_up" and len(spawned["decode-0"]) == 5
    # one that served for stable_after before it died is restarted with its count reset
    sup, spawned = make("gateway", "decode-0", stable_after=30.0, give_up_after=2,
                        is_ready=lambda child: True)  # fmt: skip
    sup.step(1.0)  # serving from here
    spawned["decode-0"][-1].code = 1
    sup.step(40.0)
    assert sup.children[1].state == "waiting" and sup.children[1].failures == 1


def test_a_node_that_served_and_is_listed_by_no_answering_gateway_is_killed_and_restarted():
    """A hung node (SIGSTOP, a frozen event loop) kept its place under `up` for good: its
    process ran, the gateways had dropped it, and nothing started it again."""
    listed: dict[str, bool | None] = {"gateway": True, "decode-0": True, "decode-1": True}
    sup, spawned = make("gateway", "decode-0", "decode-1", backoff=0.5, hung_after=10.0,
                        is_ready=lambda child: listed[child.name])  # fmt: skip
    assert sup.step(1.0)  # every child serving
    listed["decode-1"] = False  # dropped by the gateways, its process still running
    assert sup.step(5.0) and sup.step(10.9)
    assert spawned["decode-1"][-1].code is None  # not yet hung_after since last seen
    assert sup.step(11.0)
    assert spawned["decode-1"][0].code == -9 and any("hung" in e for e in sup.events)
    assert sup.step(11.1)  # its exit read: a failure, restarted after the backoff
    assert sup.step(11.7) and len(spawned["decode-1"]) == 2
    assert len(spawned["decode-0"]) == 1 and spawned["decode-0"][0].code is None


def test_a_node_is_not_judged_hung_while_loading_unknown_or_a_gateway():
    """Not serving yet (a model load), no gateway answering (a gateway restart: no evidence
    about the nodes, and the count starts over after it) and a gateway slow to answer
    /health (killing it ends every stream)."""
    listed: dict[str, bool | None] = {"gateway": False, "decode-0": False}
    sup, spawned = make("gateway", "decode-0", hung_after=10.0,
                        is_ready=lambda child: listed[child.name])  # fmt: skip
    for t in range(1, 60):  # never listed: loading for a minute
        assert sup.step(float(t))
    listed.update({"gateway": True, "decode-0": True})
    assert sup.step(60.0)
    listed.update({"gateway": False, "decode-0": None})  # the gateway does not answer
    for t in range(61, 200):
        assert sup.step(float(t))
    assert len(spawned["gateway"]) == 1 and len(spawned["decode-0"]) == 1
    assert spawned["gateway"][0].code is None and spawned["decode-0"][0].code is None
    listed["decode-0"] = False  # answering again, the node not back yet: counted from here
    assert sup.step(200.0) and sup.step(208.0) and spawned["decode-0"][0].code is None
    listed["decode-0"] = True  # back
    assert sup.step(210.0)
    listed["decode-0"] = False
    assert sup.step(219.0) and spawned["decode-0"][0].code is None
    sup.hung_after = 0.0  # off
    assert sup.step(500.0) and spawned["decode-0"][0].code is None


def test_a_node_that_hangs_soon_after_each_start_is_given_up_on():
    """Its run ends where it was last seen serving, not at the kill `hung_after` later:
    past `stable_after`, every hang reset its count and it was restarted forever."""
    listed: dict[str, bool | None] = {"gateway": True, "decode-0": True}
    sup, spawned = make("gateway", "decode-0", backoff=1.0, stable_after=30.0,
                        give_up_after=3, hung_after=60.0,
                        is_ready=lambda child: listed[child.name])  # fmt: skip
    now, delays = 0.0, []
    while sup.children[1].state != "gave_up" and now < 2000:
        listed["decode-0"] = True
        now += 1.0
        sup.step(now)  # serving: 1 s
        listed["decode-0"] = False  # then hung
        while spawned["decode-0"][-1].code is None:
            now += 1.0
            sup.step(now)
        now += 0.1
        sup.step(now)  # its exit read
        child = sup.children[1]
        if child.restart_at is not None:
            delays.append(child.restart_at - now)
            now = child.restart_at
            sup.step(now)
    assert sup.children[1].state == "gave_up" and len(spawned["decode-0"]) == 3
    assert delays == [1.0, 2.0]


def test_readiness_tells_a_node_unlisted_only_by_a_gateway_listing_nodes_for_a_while(
    monkeypatch,
):
    """A restarted gateway answers /health at once, listing no node until they register
    again (a heartbeat timeout later): that is no evidence of a hang. Nor is an answer
    without a node list (something else on the port)."""
    from pdserve import launch

    clock, answer = [0.0], [None]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch, "read_health", lambda url, timeout: answer[0])
    ready = launch.Readiness(["gateway"], ["http://g"], stale=3.0)
    node = Child("decode-0", ["d"], serves=("decode",), started=-100.0)
    gateway = Child("gateway", ["g"], essential=True, started=-100.0)
    assert ready(node) is None and ready(gateway) is False  # no gateway answers
    answer[0] = (503, {"status": "unavailable", "nodes": {}})
    clock[0] = 1.0
    assert ready(node) is None and ready(gateway) is True  # answering since 1 s only
    clock[0] = 4.5
    assert ready(node) is False  # listing nodes for 3.5 s: it can tell now
    answer[0] = (200, {"status": "ok", "nodes": {"decode-0": "decode"}})
    clock[0] = 6.0
    assert ready(node) is True
    answer[0] = (200, {"error": "not pdserve"})
    clock[0] = 8.0
    assert ready(node) is None and ready(gateway) is False


def test_the_hung_limit_outlasts_a_registration_again_and_a_drain():
    """60 s by default; refused under a drop and a registration again; never under a drain
    (a draining node a restarted gateway refused stays unlisted until it ends)."""
    from pdserve.common.config import GatewayConfig, NodeConfig
    from pdserve.common.errors import ConfigError
    from pdserve.launch import hung_limit

    gcfg, ncfg = GatewayConfig(heartbeat_timeout=2.0), NodeConfig(drain_timeout=30.0)
    assert hung_limit(None, gcfg, ncfg) == 60.0 and hung_limit(0.0, gcfg, ncfg) == 0.0
    assert hung_limit(None, GatewayConfig(heartbeat_timeout=59.0), ncfg) == 120.0
    assert hung_limit(10.0, gcfg, ncfg) == 33.0  # the drain's 30 s and a registration
    assert hung_limit(10.0, gcfg, NodeConfig(drain_timeout=2.0)) == 10.0
    for bad in (-1.0, 2.5, float("inf")):
        with pytest.raises(ConfigError):
            hung_limit(bad, gcfg, ncfg)
