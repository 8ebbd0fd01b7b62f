"""The room rule across gateways (common/node/fairness.py): an offer gives way to another
gateway's older refused request exactly when taking it would leave that request no room."""

from __future__ import annotations

from pdserve.common.node.fairness import HOLD_S, Fairness, Room

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
