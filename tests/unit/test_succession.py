"""A node restarted under its id (gateway/succession.py): a new process replaces a dead old
one at once, waits while the old one may still be alive, and a twin (both alive) is refused
after a whole lease."""

from __future__ import annotations

import asyncio

from msgspec.structs import replace

from pdserve.common.wire.protocol import Deregister, Load
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.node_messages import NodeMessages
from pdserve.gateway.succession import MAX_WAITING, Succession, Verdict
from tests.unit.test_policies import make_info

LOAD = Load(running=0, waiting=0, blocks_free=10, blocks_cached=0, blocks_in_use=0)
LEASE = 10.0  # long: every verdict below comes well before the old node's lease ends


def _cluster_with_beating_node(beat: float, until: float) -> ClusterView:
    view = ClusterView(heartbeat_timeout=LEASE)
    assert view.register(make_info("p0"), b"p0/old", 0.0, "t") is None
    t = 0.0
    while t + beat <= until:
        t += beat
        assert view.heartbeat("p0", b"p0/old", LOAD, t)
    return view


def test_a_new_process_replaces_a_silent_old_one_long_before_its_lease():
    view = _cluster_with_beating_node(beat=0.5, until=5.0)  # last beat at 5.0
    succession = Succession(view)
    # twice its beat gap of silence: dead (not half the lease, 5 s, nor the lease, 10 s)
    assert succession.verdict("p0", b"p0/new", 5.9) is Verdict.WAIT
    assert succession.verdict("p0", b"p0/new", 6.1) is Verdict.REPLACE
    assert succession.waiting == {}


def test_the_same_process_and_a_new_id_join_as_before():
    view = _cluster_with_beating_node(beat=0.5, until=2.0)
    succession = Succession(view)
    assert succession.verdict("p0", b"p0/old", 2.1) is Verdict.JOIN  # it lost our ack
    assert succession.verdict("p1", b"p1/x", 2.1) is Verdict.JOIN  # a node never seen


def test_a_twin_waits_a_whole_lease_while_the_first_beats_then_is_refused():
    view = _cluster_with_beating_node(beat=0.5, until=1.0)
    succession = Succession(view)
    t = 1.0
    verdicts = []
    while t < 1.0 + LEASE + 1.0:  # the twin asks at every beat; the first keeps beating
        t += 0.5
        assert view.heartbeat("p0", b"p0/old", LOAD, t)
        verdicts.append(succession.verdict("p0", b"p0/twin", t + 0.01))
    # asked first at 1.51: waits through 11.51 - epsilon, then left to register()'s refusal
    assert set(verdicts[:-2]) == {Verdict.WAIT}
    assert Verdict.JOIN in verdicts[-2:]
    assert "already registered" in view.register(make_info("p0"), b"p0/twin", t, "t")


def test_slow_heartbeats_widen_the_silence_that_means_dead_up_to_half_the_lease():
    view = _cluster_with_beating_node(beat=2.0, until=4.0)  # a node beating every 2 s
    succession = Succession(view)
    assert succession.verdict("p0", b"p0/new", 4.0 + 3.9) is Verdict.WAIT
    assert succession.verdict("p0", b"p0/new", 4.0 + 4.1) is Verdict.REPLACE
    view = _cluster_with_beating_node(beat=4.0, until=8.0)  # 2 x 4 s > half the lease
    succession = Succession(view)
    assert succession.verdict("p0", b"p0/new", 8.0 + LEASE / 2 + 0.1) is Verdict.REPLACE


def test_a_node_never_heard_since_registering_is_judged_by_a_quarter_lease_gap():
    view = ClusterView(heartbeat_timeout=LEASE)
    view.register(make_info("p0"), b"p0/old", 0.0, "t")
    succession = Succession(view)
    assert succession.verdict("p0", b"p0/new", LEASE / 2 - 0.1) is Verdict.WAIT
    assert succession.verdict("p0", b"p0/new", LEASE / 2 + 0.1) is Verdict.REPLACE


def test_newcomers_remembered_stay_bounded():
    view = ClusterView(heartbeat_timeout=LEASE)
    for i in range(MAX_WAITING + 50):
        view.register(make_info(f"p{i}"), f"p{i}/old".encode(), 0.0, "t")
    succession = Succession(view)
    for i in range(MAX_WAITING + 50):
        assert succession.verdict(f"p{i}", f"p{i}/new".encode(), 0.1) is Verdict.WAIT
    assert len(succession.waiting) <= MAX_WAITING


def test_a_deregister_counts_as_planned_only_from_a_draining_node():
    """A node leaving after its drain: what it held is no loss of the requests'. A node
    whose loop failed (a request that crashes the engine step) deregisters too, on its way
    down: that is a loss, or such a request would be placed again without end."""
    kinds: list[str] = []

    async def drop(node_id: str, why: str, kind: str = "lost") -> None:
        kinds.append(kind)

    for draining in (True, False):
        view = ClusterView(heartbeat_timeout=LEASE)
        view.register(make_info("p0"), b"p0/1", 0.0, "t")
        view.heartbeat("p0", b"p0/1", replace(LOAD, draining=draining), 0.5)
        messages = NodeMessages.__new__(NodeMessages)
        messages.cluster, messages.drop = view, drop
        asyncio.run(messages._on_deregister(b"p0/1", Deregister(node_id="p0")))
    assert kinds == ["preempted", "lost"]
