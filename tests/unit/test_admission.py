"""Admission order among requests waiting at the gateway (gateway/admission.py): pure."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.admission import ORDERS, Waiting, can_meet, order

NOW = 100.0


def w(key, waited=0.0, prefill=1.0, slo=math.inf, resumed=False):
    arrived = NOW - waited
    return Waiting(key, arrived, prefill, arrived + slo, resumed)


def keys(ws):
    return [x.key for x in ws]


def test_fifo_is_arrival_order():
    ws = [w(2, 1, 0.1), w(0, 3, 9.0), w(1, 2, 0.5)]
    assert keys(order("fifo", ws, NOW, max_wait=60)) == [0, 1, 2]


def test_spf_puts_short_prefills_first_and_ages_long_ones():
    long_old, short_new, mid = w(0, 4.0, 5.0), w(1, 0.0, 0.2), w(2, 0.5, 1.0)
    assert keys(order("spf", [long_old, short_new, mid], NOW, 60, aging=0.0)) == [1, 2, 0]
    # each second waited forgives `aging` seconds of prefill: 5 - 4 * 1.0 = 1 > 1 - 0.5 > 0.2
    assert keys(order("spf", [long_old, short_new, mid], NOW, 60, aging=1.0)) == [1, 2, 0]
    # -3, 0, 0.2
    assert keys(order("spf", [long_old, short_new, mid], NOW, 60, aging=2.0)) == [0, 2, 1]


def test_deadline_serves_the_earliest_deadline_that_can_still_be_met():
    tight = w(0, waited=0.0, prefill=0.5, slo=1.0)  # due in 1 s, needs 0.5 s: feasible
    loose = w(1, waited=0.0, prefill=0.5, slo=5.0)
    lost = w(2, waited=3.0, prefill=0.5, slo=2.0)  # due a second ago: cannot make it
    assert not can_meet(lost, NOW) and can_meet(tight, NOW)
    # the lost one yields to both, and is still served, after them
    assert keys(order("deadline", [lost, loose, tight], NOW, 60)) == [0, 1, 2]


def test_resumed_and_starving_requests_go_first_oldest_first():
    fresh_short = w(5, 0.0, 0.01)
    starving = w(1, 10.0, 50.0)
    starving_older = w(0, 12.0, 80.0)
    resumed = w(7, 0.0, 30.0, resumed=True)
    for policy in ORDERS:
        got = order(policy, [fresh_short, starving, resumed, starving_older], NOW, max_wait=5)
        assert keys(got) == [7, 0, 1, 5]


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="unknown admission order"):
        order("lifo", [], NOW, 1)


waitings = st.lists(
    st.builds(
        w,
        key=st.integers(0, 10**6),
        waited=st.floats(0, 30),
        prefill=st.floats(0, 20),
        slo=st.floats(0.1, 10) | st.just(math.inf),
        resumed=st.booleans(),
    ),
    max_size=30,
    unique_by=lambda x: x.key,
).map(
    lambda ws: [
        Waiting(i, x.arrived, x.prefill_s, x.deadline, x.resumed)
        for i, x in enumerate(sorted(ws, key=lambda x: x.arrived))
    ]
)


@settings(max_examples=300, deadline=None)
@given(waitings, st.sampled_from(ORDERS), st.floats(0.5, 20), st.floats(0, 5))
def test_no_request_starves(ws, policy, max_wait, aging):
    """Every order is a permutation, and a request that has waited `max_wait` is preceded
    only by re-placed requests and requests that arrived before it: its wait is bounded by
    `max_wait` plus the time to place those."""
    got = order(policy, ws, NOW, max_wait, aging)
    assert sorted(keys(got)) == sorted(keys(ws))
    for i, x in enumerate(got):
        if NOW - x.arrived >= max_wait and not x.resumed:
            assert all(y.resumed or y.key < x.key for y in got[:i])
    resumed = [x.key for x in got if x.resumed]
    assert keys(got[: len(resumed)]) == sorted(resumed)  # mid-stream requests first


@settings(max_examples=200, deadline=None)
@given(waitings, st.floats(0.5, 20))
def test_deadline_never_puts_a_lost_request_before_one_that_can_still_be_served(ws, max_wait):
    got = order("deadline", ws, NOW, max_wait)
    fresh = [x for x in got if not x.resumed and NOW - x.arrived < max_wait]
    feasible = [can_meet(x, NOW) for x in fresh]
    assert feasible == sorted(feasible, reverse=True)
    met = [x.deadline for x in fresh if can_meet(x, NOW)]
    assert met == sorted(met)
