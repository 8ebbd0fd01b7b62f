"""The room rule across gateways (common/node/fairness.py): an offer gives way to another
gateway's older refused request exactly when taking it would leave that request no room."""

from __future__ import annotations

from pdserve.common.node.fairness import HOLD_S, STALE, Fairness, Room
from pdserve.common.node.links import beat_delay

A, B = object(), object()  # two gateways' links


def test_a_younger_offer_gives_way_to_an_older_claim_that_it_would_crowd_out():
    f = Fairness()
    f.answered(B, "b1", since=10.0, tokens=500, accepted=False, now=20.0)  # refused: a claim
    one_slot = Room(tokens=4000, slots=1)
    claim = f.gives_way(A, since=19.9, tokens=100, room=one_slot, now=20.03)
    assert claim is not None and claim.rid == "b1"
    # the same offer from B's own gateway, or an older one from A, does not give way
    assert f.gives_way(B, since=19.9, tokens=100, room=one_slot, now=20.03) is None
    assert f.gives_way(A, since=9.0, tokens=100, room=one_slot, now=20.03) is None


def test_no_giving_way_when_both_fit_or_the_claim_does_not_fit_anyway():
    f = Fairness()
    f.answered(B, "b1", since=10.0, tokens=500, accepted=False, now=20.0)
    # room for both: nobody waits
    assert f.gives_way(A, 19.0, 100, Room(tokens=4000, slots=2), 20.03) is None
    # the claim does not fit now either (a longer batch must drain first): holding the room
    # would leave it idle, so the younger offer takes it
    assert f.gives_way(A, 19.0, 100, Room(tokens=400, slots=1), 20.03) is None
    # the younger offer is what leaves too few tokens
    assert f.gives_way(A, 19.0, 3600, Room(tokens=4000, slots=3), 20.03) is not None


def test_a_claim_ends_when_accepted_or_no_longer_offered():
    f = Fairness()
    f.answered(B, "b1", 10.0, 500, False, now=20.0)
    f.answered(B, "b1", 10.0, 500, False, now=20.2)  # offered again: renewed
    assert f.gives_way(A, 19.0, 100, Room(4000, 1), now=20.2 + HOLD_S - 0.001) is not None
    assert f.gives_way(A, 19.0, 100, Room(4000, 1), now=20.2 + HOLD_S + 0.001) is None
    f.answered(B, "b1", 10.0, 500, False, now=21.0)
    f.answered(B, "b1", 10.0, 500, True, now=21.1)  # accepted: no claim
    assert f.gives_way(A, 19.0, 100, Room(4000, 1), now=21.1) is None


def test_a_gateways_claim_is_its_last_refused_offer():
    f = Fairness()
    f.answered(B, "old", 11.0, 100, False, now=20.0)
    f.answered(B, "young", 15.0, 100, False, now=20.01)  # "old" was placed elsewhere
    assert f.claims[B].rid == "young"
    f.answered(B, "other", 16.0, 100, True, now=20.02)  # another request's acceptance
    assert f.claims[B].rid == "young"
    f.forget(B)  # its gateway is gone
    assert f.gives_way(A, 19.0, 100, Room(4000, 1), now=20.0) is None


def test_an_offer_on_a_stale_view_is_refused_first_and_only_when_the_node_has_more():
    f = Fairness()
    room = Room(tokens=4000, slots=2)
    # the gateway believed 100 prompt tokens of the others' in prefill; the node has 300
    assert f.refusal(A, 19.0, 100, room, 20.0, believed=100, actual=300) == (STALE, 4000)
    # as much as believed, or less (a pass ended since): the view is good enough
    assert f.refusal(A, 19.0, 100, room, 20.0, believed=300, actual=300) is None
    assert f.refusal(A, 19.0, 100, room, 20.0, believed=500, actual=300) is None
    # no belief (one gateway, or an older gateway): never stale
    assert f.refusal(A, 19.0, 100, room, 20.0, believed=-1, actual=300) is None
    # a claim to give way to, on a true view: the fairness refusal, room 0
    f.answered(B, "b1", since=10.0, tokens=500, accepted=False, now=20.0)
    why = f.refusal(A, 19.9, 100, Room(tokens=4000, slots=1), 20.03, believed=0, actual=0)
    assert why is not None and why[0] != STALE and why[1] == 0


def test_heartbeats_of_nodes_started_apart_fall_on_the_same_instants():
    interval = 0.5
    for start in (1000.0, 1000.13, 1000.49, 1001.3):
        now, beats = start, []
        for _ in range(4):
            now += beat_delay(now, interval)
            beats.append(round(now / interval, 6))
        assert all(b == int(b) for b in beats), beats  # on the interval's multiples
        assert [b - beats[0] for b in beats] == [0, 1, 2, 3]  # one per interval
