"""The gateway's request table: one owner of where each attempt runs; every per-node number
is derived from it, and every transition keeps the per-node index consistent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.table import Phase, RequestTable
from tests.conftest import gateway_request

make_request = gateway_request


def test_an_attempt_moves_from_offer_to_prefill_to_decode_and_nodes_see_it():
    table = RequestTable()
    req = make_request("a", 40)
    attempt = table.open(req, 40)
    assert attempt.phase is Phase.OFFERED and table.on_node("p0") == []
    table.commit(attempt, "p0", "d0", blocks=3, now=5.0)
    assert table.in_prefill("p0") == [attempt] and table.headed_to("d0") == [attempt]
    assert table.promised("d0", 4.0, ()) == 3  # placed after the report
    assert table.promised("d0", 5.0, ()) == 3  # reported, but not reserved there yet
    assert table.promised("d0", 5.0, {"a.0"}) == 0  # the report shows it
    assert req.ran_on == {"prefill": "p0", "decode": "d0"}
    table.prefilled(attempt)
    assert table.in_prefill("p0") == [] and table.on_node("p0") == [attempt]  # holds the KV
    table.delivered(attempt, 1.0)
    assert table.on_node("p0") == [] and attempt.prefill is None
    assert table.close("a.0") is attempt and len(table) == 0 and table.on_node("d0") == []


def test_a_redirect_moves_the_kv_and_a_renewal_spends_the_wire_id():
    table = RequestTable()
    req = make_request("b")
    attempt = table.open(req, 32)
    table.commit(attempt, "p0", "d0", blocks=2, now=1.0)
    table.redirect(attempt, "d1", blocks=2, now=2.0)
    assert table.headed_to("d0") == [] and table.headed_to("d1") == [attempt]
    assert req.ran_on["decode"] == "d1"
    req.timeline["placing.0"] = 1.0
    fresh = table.renew(req)
    assert fresh.wire_id == "b.1" and table.get("b.0") is None and table.current(req) is fresh
    assert table.on_node("p0") == [] and fresh.phase is Phase.OFFERED
    assert req.timeline["placing.1"] == 1.0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["open", "commit", "prefilled", "delivered", "redirect", "close", "renew"]),
        st.integers(0, 5),  # which request
        st.integers(0, 2),  # which node
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_per_node_index_always_matches_the_attempts(ops):
    table = RequestTable()
    reqs = [make_request(f"r{i}") for i in range(6)]
    for op, i, n in ops:
        req, attempt = reqs[i], table.current(reqs[i])
        if op == "open" and attempt is None:
            table.open(req, 32)
        elif attempt is None:
            continue
        elif op == "commit" and attempt.phase is Phase.OFFERED:
            table.commit(attempt, f"p{n}", f"d{n}", 2, float(len(ops)))
        elif op == "prefilled" and attempt.phase is Phase.PREFILL:
            table.prefilled(attempt)
        elif op == "delivered" and attempt.phase is Phase.DECODE:
            table.delivered(attempt, 1.0)
        elif op == "redirect" and attempt.phase is not Phase.OFFERED:
            table.redirect(attempt, f"d{(n + 1) % 3}", 2, 0.0)
        elif op == "close":
            table.close(attempt.wire_id)
        elif op == "renew":
            table.renew(req)
    for node in [f"{r}{k}" for r in "pd" for k in range(3)]:
        expected = {a.wire_id for a in table if node in a.nodes()}
        assert {a.wire_id for a in table.on_node(node)} == expected


def test_a_migration_keeps_the_old_decode_node_holding_until_the_kv_lands_and_leases_follow():
    table = RequestTable()
    req = make_request("m", 40)
    attempt = table.open(req, 40)
    table.commit(attempt, "p0", "d0", blocks=3, now=1.0)
    assert table.work_since("p0") == 1.0 and table.work_since("d0") is None  # prefill's turn
    table.prefilled(attempt)
    assert table.work_since("p0") is None  # first token out: nothing more due from it
    table.delivered(attempt, 2.0)
    assert table.work_since("d0") == 2.0  # decode steps are due from d0 now
    table.migrate(attempt, "d1", blocks=4, now=3.0)  # d0 drains
    assert attempt.phase is Phase.DECODE and (attempt.prefill, attempt.decode) == ("d0", "d1")
    assert table.on_node("d0") == [attempt] and table.headed_to("d1") == [attempt]
    assert table.work_since("d0") is None and table.work_since("d1") is None  # KV in flight
    table.delivered(attempt, 4.0)  # d1 acknowledged: d0 lets go
    assert table.on_node("d0") == [] and table.work_since("d1") == 4.0
    assert table.close("m.0") is attempt and table.on_node("d1") == []


def test_a_migration_with_no_taker_stays_on_the_old_node():
    table = RequestTable()
    req = make_request("s", 40)
    attempt = table.open(req, 40)
    table.commit(attempt, "p0", "d0", blocks=3, now=1.0)
    table.prefilled(attempt)
    table.delivered(attempt, 2.0)
    table.migrate(attempt, "d1", blocks=4, now=3.0)
    table.stay(attempt, 5.0)  # d1 refused, nobody else can take it
    assert (attempt.prefill, attempt.decode) == (None, "d0") and req.ran_on["decode"] == "d0"
    assert table.on_node("d1") == [] and table.on_node("d0") == [attempt]
    assert table.work_since("d0") == 5.0


def test_a_colocated_node_owes_decode_steps_after_its_first_token():
    """A colocated node prefills and decodes the attempt: no KV is delivered to start its
    decode steps' lease, which then never ran (a hung engine whose loop still heartbeats
    left its streams waiting forever); its work runs from the placement on."""
    table = RequestTable()
    attempt = table.open(make_request("c", 40), 40)
    table.commit(attempt, "c0", "c0", blocks=3, now=1.0)
    assert table.work_since("c0") == 1.0  # its first token is due
    table.prefilled(attempt)
    assert attempt.phase is Phase.DECODE and table.work_since("c0") == 1.0  # and its steps
    table.close("c.0")
    assert table.work_since("c0") is None


def test_a_renewed_attempt_starts_without_the_spent_ones_early_tokens():
    """A colocated node's tokens 1..2 read before its Accept (two sockets), then the offer
    timed out: the fresh attempt must not take them as its own (its token 0 pulled them into
    the stream, and its own 1..2 were dropped as duplicates)."""
    table = RequestTable()
    req = make_request("e", 40)
    table.open(req, 40)
    assert not req.add_token(1, 11, None) and not req.add_token(2, 12, None)  # wait for 0
    assert req.pending and req.gap_since is not None
    table.renew(req)
    assert req.attempt == 1 and not req.pending and req.gap_since is None


def test_a_hand_off_that_never_completes_is_found_after_the_limit():
    """A request's KV on its way to the decode node after its first token (or a redirect,
    or a move off a draining node) is a stalled hand-off once `limit` has passed since the
    later of those and of the gateway's last stall; delivered, prefilled in place by its
    decode node or on a colocated node (nothing to hand off), it is not."""
    table = RequestTable()
    moving = table.open(make_request("m"), 32)
    table.commit(moving, "p0", "d0", blocks=2, now=0.0)
    assert table.stalled_handoffs(100.0, 10.0) == []  # in prefill: the progress lease's
    table.prefilled(moving, 50.0)
    assert table.stalled_handoffs(60.0, 10.0) == []
    assert table.stalled_handoffs(60.5, 10.0) == [moving]
    assert table.stalled_handoffs(60.5, 10.0, awake=55.0) == []  # its news may wait unread
    table.redirect(moving, "d1", blocks=2, now=58.0)  # another decode node: timed anew
    assert table.stalled_handoffs(60.5, 10.0) == []
    assert table.stalled_handoffs(68.5, 10.0) == [moving]
    table.delivered(moving, 69.0)
    assert table.stalled_handoffs(200.0, 10.0) == []
    table.migrate(moving, "d2", blocks=2, now=70.0)  # d1 drains: the KV moves on
    assert table.stalled_handoffs(80.5, 10.0) == [moving]
    table.delivered(moving, 81.0)
    together = table.open(make_request("c"), 32)
    table.commit(together, "c0", "c0", blocks=2, now=0.0)  # a colocated node
    table.prefilled(together, 1.0)
    assert table.stalled_handoffs(200.0, 10.0) == []
