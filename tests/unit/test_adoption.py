"""A node's orphans when gateways misbehave (common/node/adoption.py): a client resuming one
stream at two gateways at once, and a gateway that fell silent and answers again."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import zmq.asyncio

from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.adoption import FREED, Adoption, tell_returned
from pdserve.common.node.gateways import Gateways
from pdserve.common.node.links import GatewayLink, Gone
from pdserve.common.node.role import NodeRequest
from pdserve.common.node.runtime import NodeRuntime
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import (
    REGISTERING,
    Adopt,
    Preempted,
    PrefillFailed,
    Release,
    Wanted,
)
from tests.unit.test_several_gateways import _Node


def _links(ctx: zmq.asyncio.Context, *ids: str) -> list[GatewayLink]:
    links = []
    for port, gateway_id in enumerate(ids, start=9):
        link = GatewayLink(ctx, f"tcp://127.0.0.1:{port}", "node-x")
        link.gateway_id, link.registered = gateway_id, True
        links.append(link)
    return links


def _sent(link: GatewayLink) -> list:
    """What the node sends `link`'s gateway, on its control socket and its token socket."""
    out: list = []

    async def send(msg) -> None:
        out.append(msg)

    link.send = link.push = send  # type: ignore[method-assign]
    return out


def _seq(rid: str, *outputs: int) -> Sequence:
    """A request of prompt [5, 6] that has made these output tokens."""
    seq = Sequence.new(rid, [5, 6], SamplingParams(max_tokens=9, temperature=0.0))
    seq.token_ids += outputs
    return seq


def _node(links: list[GatewayLink], *rids: str, **kw: float) -> tuple[_Node, Gateways, Adoption]:
    """A node holding `rids` for the first gateway of `links`, and its adoption."""
    node = _Node(*rids)
    gateways = Gateways("node-x", links, node)  # type: ignore[arg-type]
    for rid in rids:
        assert gateways.owners.adopt(rid, links[0])
    return node, gateways, Adoption(gateways, node, **kw)  # type: ignore[arg-type]


async def test_a_stream_resumed_at_two_gateways_at_once_is_not_bounced_between_them():
    """Gateway A serves a stream whose client resumes it at B and at C at once. The node
    tells the gateway serving it once per asker (`Wanted`): A lets it go, B adopts it, C's
    asking makes B let it go once, and then B and C ask in vain (no `Wanted` every round,
    which would move the stream back and forth while both ask) until the pair's window
    (seconds) is over."""
    ctx = zmq.asyncio.Context()
    a, b, c = links = _links(ctx, "g-a", "g-b", "g-c")
    told: list[tuple[str, str]] = []  # (gateway told, request id)
    try:
        for link in links:

            async def send(msg, link=link) -> None:
                if isinstance(msg, Wanted):
                    told.append((link.gateway_id, msg.request_id))

            link.send = send  # type: ignore[method-assign]
        node = _Node("r.0")
        node.requests["r.0"] = NodeRequest(seq=_seq("r.0", 7))  # decoding
        gateways = Gateways("node-x", links, node)  # type: ignore[arg-type]
        assert gateways.owners.adopt("r.0", a)
        adoption = Adoption(gateways, node, grace=10.0)
        ask = Adopt(streams=[("r", 0)])
        for _ in range(3):  # rounds of B and C while A has not let go
            await adoption.on_gateway(ask, b)
            await adoption.on_gateway(ask, c)
        assert told == [("g-a", "r.0")] * 2  # once for B, once for C
        await adoption.on_gateway(Release(request_id="r.0"), a)
        await adoption.on_gateway(ask, b)
        assert gateways.owners.get("r.0") is b
        for _ in range(3):
            await adoption.on_gateway(ask, c)
        assert told[2:] == [("g-b", "r.0")]  # B told once: it lets go
        await adoption.on_gateway(Release(request_id="r.0"), b)
        await adoption.on_gateway(ask, c)
        assert gateways.owners.get("r.0") is c
        for _ in range(3):
            await adoption.on_gateway(ask, b)
        assert told[3:] == [("g-c", "r.0")]
        await adoption.on_gateway(Release(request_id="r.0"), c)
        await adoption.on_gateway(ask, b)
        for _ in range(3):  # B holds it: C asks in vain, B is not told again
            await adoption.on_gateway(ask, c)
        assert gateways.owners.get("r.0") is b and len(told) == 4
        # later, one client moves between the two gateways again: C's asking tells B again
        # once the pair's `window` is over (it used to be never: 409 until B's send timeout)
        now = adoption.clock()
        adoption.clock = lambda: now + adoption.window + 0.1
        for _ in range(3):
            await adoption.on_gateway(ask, c)
        assert told[4:] == [("g-b", "r.0")]
        node.requests.clear()  # the stream ends: what was told is forgotten with it
        for _ in range(2):
            adoption.sweep(node.load().held)
        assert not adoption.told
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_what_ended_while_its_gateway_was_silent_is_freed_when_it_answers_again():
    """A gateway falls silent (slow, not dead) while requests of its end: they are kept as
    ended orphans. It answers again under the same id: they stay adoptable orphans (not its
    again, so its lease does not count them) and are freed at the grace's end."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", grace=3.0, heartbeat_timeout=1.0)
        seq = _seq("r.0", 7, 8)
        del node.requests["r.0"]
        adoption.ended(NodeRequest(seq=seq), "length", 99.5)
        own.silent_since = 100.0
        adoption.silenced(own)
        own.silent_since = None  # it answers again, the same process
        assert gateways.owners.orphan("r.0") and list(adoption.finished) == ["r.0"]
        for _ in range(3):
            adoption.sweep(node.load().held)
        adoption.expire(102.9)
        assert list(adoption.finished) == ["r.0"]
        adoption.expire(103.1)  # the grace since it fell silent is over: freed
        assert not adoption.finished
        for _ in range(2):
            adoption.sweep(node.load().held)
        assert not gateways.owners.of and not gateways.gone
        answers = adoption.adopt(Adopt(streams=[("r", 0)]), other)
        assert answers == []
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_an_ended_stream_let_go_at_its_end_is_kept_through_every_resume():
    """A resumable stream's gateway lets it go as it ends (`Release`: its client may not have
    the last chunks). Another gateway adopts it whole; that one lets it go again at its end
    and a third resume gets it too, until the grace ends."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", grace=3.0)
        seq = _seq("r.0", 7, 8)
        del node.requests["r.0"]
        adoption.ended(NodeRequest(seq=seq), "length", 100.0)
        adoption.release("r.0", own, 100.0)
        for asker, t in ((other, 101.0), (own, 102.0)):
            (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), asker)
            assert (answer[0], answer[1].found, answer[1].output_ids) == ("r.0", True, [7, 8])
            assert not adoption.finished and gateways.owners.get("r.0") is asker
            adoption.release("r.0", asker, t)  # its end at that gateway: kept again
            assert list(adoption.finished) == ["r.0"]
        adoption.expire(105.1)  # 3 s after the last release
        assert not adoption.finished
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_an_ended_stream_asked_for_again_by_its_adopter_gets_the_same_answer():
    """A gateway adopted an ended orphan and asks again (its `Adopted` lost, or late past its
    next round): the same answer, not silence that leaves its client waiting for the round's
    timeout. Only an adopted one: a stream that ended for its live gateway stays its own."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", "s.0", grace=3.0)
        counted: list[tuple[str, int]] = []  # pdserve:orphans_total
        adoption.count = lambda outcome, n: counted.append((outcome, n))
        del node.requests["r.0"], node.requests["s.0"]
        adoption.ended(NodeRequest(seq=_seq("r.0", 7, 8)), "length", 100.0)
        adoption.ended(NodeRequest(seq=_seq("s.0", 9)), "length", 100.0)
        adoption.release("r.0", own, 100.0)
        # a stream that just ended for its live gateway, never let go (not resumable): no
        # gateway adopts it, its own neither
        assert adoption.adopt(Adopt(streams=[("s", 0)]), own) == []
        answers = [adoption.adopt(Adopt(streams=[("r", 2)]), other) for _ in range(2)]
        for ((wire_id, answer),) in answers:
            assert (wire_id, answer.found, answer.output_ids) == ("r.0", True, [7, 8])
            assert answer.finish_reason == "length"
        assert gateways.owners.get("r.0") is other and not adoption.finished
        assert counted == [("adopted", 1)]  # asked twice, one stream saved
        adoption.release("r.0", other, 101.0)  # its end at the adopter: kept for the grace
        assert list(adoption.finished) == ["r.0"]
        adoption.expire(104.1)  # nobody resumed it again: an ended one freed
        assert counted == [("adopted", 1), ("freed_running", 0), ("freed_ended", 1)]
        assert not adoption.finished
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_what_ends_while_its_gateway_is_silent_is_freed_when_it_answers_again():
    """A request ends while its gateway is silent (slow, not dead): its last tokens still go
    to that gateway (sent after the end; a paused one reads them when it wakes). The
    gateway answers again under the same id: the ended stream stays an adoptable orphan,
    freed at the grace's end, not kept forever; that gateway's `Release` (here at a stop
    string) ends it where it ended there and times the grace anew."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", grace=3.0, heartbeat_timeout=1.0)
        own.silent_since = 100.0
        adoption.silenced(own)
        seq = _seq("r.0", 7, 8)
        del node.requests["r.0"]
        adoption.ended(NodeRequest(seq=seq), "length", 101.0)
        assert gateways.link_for("r.0") is own  # where its last token goes next
        assert not adoption.registered(own, "g-own", 101.2)  # it answers again, the same
        own.silent_since = None
        assert gateways.owners.orphan("r.0") and list(adoption.finished) == ["r.0"]
        adoption.release("r.0", own, 101.5, 1)  # it read the last tokens: a stop at the 1st
        assert adoption.finished["r.0"][0].seq.token_ids == [5, 6, 7]
        for _ in range(3):
            adoption.sweep(node.load().held)
        adoption.expire(104.4)
        assert list(adoption.finished) == ["r.0"]
        adoption.expire(104.6)  # the grace since its gateway let it go is over: freed
        assert not adoption.finished
        for _ in range(2):
            adoption.sweep(node.load().held)
        assert not gateways.owners.of and not gateways.gone
        assert adoption.adopt(Adopt(streams=[("r", 0)]), other) == []
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_a_gateway_restarted_fast_leaves_what_ended_for_it_adoptable():
    """A gateway process is replaced before its silence is noticed (it registers again
    under a new id): what ended for the old one lately may never have reached it, so it is
    kept as an orphan for the grace, like the old one's running requests."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-old", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", "s.0", grace=3.0)
        seq = _seq("r.0", 7)
        del node.requests["r.0"]
        adoption.ended(NodeRequest(seq=seq), "length", 100.0)
        assert adoption.registered(own, "g-new", 100.5)  # the node's `_registered`
        own.gateway_id = "g-new"
        assert len(gateways.gone) == 2  # one Gone for the old process (and the Gateways')
        assert gateways.owners.orphan("r.0") and gateways.owners.orphan("s.0")
        (answer,) = adoption.adopt(Adopt(streams=[("r", 0)]), other)
        assert answer[1].found and answer[1].output_ids == [7]
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_kv_for_a_restarted_gateway_is_kept_as_long_as_its_other_orphans():
    """KV that arrives naming a gateway that came back under a new id is that gateway's
    orphan for the grace from when it went, not from an older stream it let go (the oldest
    `Gone` of that id, which freed it at once)."""
    ctx = zmq.asyncio.Context()
    own, _ = links = _links(ctx, "g-old", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", grace=3.0)
        adoption.release("r.0", own, 100.0)  # a stream let go long before
        own.silent_since = 110.0
        adoption.retire(own, 110.5)
        own.gateway_id, own.silent_since = "g-new", None
        assert gateways.adopt("k.0", "g-old")  # its KvHeader names the old id
        node.requests["k.0"] = None
        adoption.expire(112.0)
        assert "k.0" in node.requests and "k.0" not in node.freed
        adoption.expire(113.1)  # 3 s after the old gateway fell silent
        assert "k.0" in node.freed
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_a_stream_its_gateway_ended_at_a_stop_string_is_kept_as_ended_there():
    """The gateway ends a resumable stream at a stop string after 2 tokens; the node has
    decoded 4 before its `Release` comes. The node ends it (KV freed) and keeps the 2 for a
    resume; the step that was computing it ending it afterwards changes nothing. Released
    after the node ended it on its own, the same."""
    ctx = zmq.asyncio.Context()
    own, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", "s.0", grace=3.0)
        seqs = {rid: _seq(rid, 7, 8, 9, 10) for rid in ("r.0", "s.0")}
        node.requests.update({rid: NodeRequest(seq=seq) for rid, seq in seqs.items()})
        adoption.release("r.0", own, 100.0, tokens=2)
        assert node.freed == ["r.0"]  # its KV: the gateway's stop ended it
        assert gateways.owners.adopt("k.0", own)  # its KV on its way here (an intake)
        adoption.release("k.0", own, 100.0, tokens=2)
        assert node.freed == ["r.0", "k.0"] and "k.0" not in adoption.finished
        adoption.ended(NodeRequest(seq=seqs["r.0"]), "length", 100.1)  # that step's end
        del node.requests["s.0"]
        adoption.ended(NodeRequest(seq=seqs["s.0"]), "length", 100.1)
        adoption.release("s.0", own, 100.2, tokens=3)
        adoption.release("s.0", own, 100.3, tokens=2**62)  # again, absurd: changes nothing
        for rid, kept in (("r", [7, 8]), ("s", [7, 8, 9])):
            (answer,) = adoption.adopt(Adopt(streams=[(rid, 0)]), other)
            assert answer[1].output_ids == kept and answer[1].finish_reason == "stop"
        adoption.ended(NodeRequest(seq=seqs["r.0"]), "length", 100.3)  # late: still 2
        assert adoption.recent["r.0"][0].seq.token_ids == [5, 6, 7, 8]
        assert seqs["r.0"].token_ids == [5, 6, 7, 8, 9, 10]  # the engine's own untouched
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_a_stream_without_its_attempts_first_token_is_in_prefill_not_adopted():
    """A colocated node (or a decode node prefilling it itself) holds an orphan it has not
    made this attempt's first token of: a fresh stream, or one placed again with its kept
    output as prompt. Adopted, its gateway would book it as decoding here and drop the
    FirstToken to come; it is answered "in prefill" until that token is made."""
    ctx = zmq.asyncio.Context()
    _, other = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", "s.1", grace=10.0)
        node.requests["r.0"] = NodeRequest(seq=_seq("r.0"))  # prefilling
        again = Sequence.new("s.1", [5, 6, 7, 8], SamplingParams(max_tokens=9, temperature=0.0))
        node.requests["s.1"] = NodeRequest(seq=again, prompt_len=2)  # 7, 8 kept from s.0
        for rid in ("r.0", "s.1"):
            gateways.owners.move(rid, Gone("g-own", 100.0))  # its gateway died
        ask = Adopt(streams=[("r", 0), ("s", 2)])
        answers = dict(adoption.adopt(ask, other))
        assert {w: (a.found, a.reason) for w, a in answers.items()} == {
            "r.0": (False, "in prefill"), "s.1": (False, "in prefill")}  # fmt: skip
        for rid in ("r.0", "s.1"):  # each makes its first token
            node.requests[rid].seq.token_ids.append(9)
        answers = dict(adoption.adopt(ask, other))
        assert answers["r.0"].found and answers["r.0"].output_ids == [9]
        assert answers["s.1"].found and answers["s.1"].output_ids == [7, 8, 9]
        assert answers["s.1"].base == 2  # 7, 8: the kept output the client has
        assert gateways.owners.get("r.0") is other and gateways.owners.get("s.1") is other
    finally:
        for link in links:
            link.close()
        ctx.term()


def test_a_reservation_whose_kv_never_came_is_freed_with_its_gateways_orphans():
    """A decode node reserved blocks for a request's KV (owned by the gateway that placed
    it), no frame came (its prefill node died), and the gateway fell silent past the grace:
    the reservation is freed with the orphans. It is not a running request, and was left
    held for good (the intake's stall timer starts at the first frame)."""
    ctx = zmq.asyncio.Context()
    own, _ = links = _links(ctx, "g-own", "g-other")
    try:
        node, gateways, adoption = _node(links, "r.0", grace=3.0)
        assert gateways.owners.adopt("k.0", own)  # reserved: KV on its way, not running
        base = node.load()
        node.load = lambda: msgspec.structs.replace(base, held=(*base.held, "k.0"))
        own.silent_since = 100.0
        adoption.expire(103.1)
        assert sorted(node.freed) == ["k.0", "r.0"]
    finally:
        for link in links:
            link.close()
        ctx.term()


async def test_a_silent_or_registering_gateway_adopts_nothing_and_another_still_can():
    """Gateway A is silent (an orphan's owner). B is silent too, or registering again: its
    `Adopt` (read before its `RegisterAck`) is refused, since a stream moved to B would
    stay an orphan and C could adopt it as well (two gateways serving one stream). C, live
    and registered, adopts it. A wrong position asked for tells nobody (`Wanted` is for a
    stream a live gateway serves: a client's bad Last-Event-ID hangs nothing up)."""
    ctx = zmq.asyncio.Context()
    a, b, c = links = _links(ctx, "g-a", "g-b", "g-c")
    told: list[tuple[str, str]] = []
    try:
        for link in links:

            async def send(msg, link=link) -> None:
                if isinstance(msg, Wanted):
                    told.append((link.gateway_id, msg.request_id))

            link.send = send  # type: ignore[method-assign]
        node, gateways, adoption = _node(links, "r.0", grace=10.0)
        node.requests["r.0"] = NodeRequest(seq=_seq("r.0", 7, 8))
        a.silent_since = 100.0
        assert gateways.owners.orphan("r.0")
        b.silent_since = 100.5
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), b)
        assert not answer[1].found and answer[1].reason == REGISTERING
        b.silent_since, b.registered = None, False  # knocking: its RegisterAck not read yet
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), b)
        assert not answer[1].found and answer[1].reason == REGISTERING
        assert gateways.owners.orphan("r.0")
        await adoption.on_gateway(Adopt(streams=[("r", 9)]), c)  # not a position it has
        assert told == [] and gateways.owners.orphan("r.0")
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), c)
        assert answer[1].found and gateways.owners.get("r.0") is c
    finally:
        for link in links:
            link.close()
        ctx.term()


@pytest.mark.parametrize("pushes", [True, False], ids=["decode", "prefill"])
async def test_what_was_taken_from_a_silent_gateway_is_told_to_it_when_it_answers(pushes):
    """A is silent with two streams: B adopts one, the grace frees the other. A answers again
    as the same process, both still in its table: it is told (`Wanted` for the adopted one:
    its connection there is dead to the client; the freed one given back, to be placed
    again: `Preempted` on a decode node's token socket, `PrefillFailed` from a prefill
    node), once. A restarted B (a new process, no table) is told nothing."""
    ctx = zmq.asyncio.Context()
    a, b = links = _links(ctx, "g-a", "g-b")
    out = _sent(a)
    try:
        node, _, adoption = _node(links, "r.0", "s.0", grace=3.0)
        node.requests["r.0"] = NodeRequest(seq=_seq("r.0", 7))
        a.silent_since = 100.0
        adoption.silenced(a, 100.0)
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), b)
        assert answer[1].found
        adoption.expire(103.5)  # the grace is over: s.0, still running, freed
        assert node.freed == ["s.0"]
        assert not adoption.registered(a, "g-a", 104.0)  # the same process
        a.silent_since = None
        await tell_returned(adoption, a, pushes)
        gave_back = (Preempted(node_id="node-x", request_id="s.0", reason=FREED) if pushes
                     else PrefillFailed(request_id="s.0", reason=FREED))  # fmt: skip
        assert out == [Wanted(request_id="r.0", taken=True), gave_back]
        await tell_returned(adoption, a, pushes)
        assert len(out) == 2  # told once
        b.silent_since = 105.0  # now B falls silent, and comes back a new process
        adoption.silenced(b, 105.0)
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), a)  # A adopts r back
        assert answer[1].found and adoption.taken
        assert adoption.registered(b, "g-b2", 106.0)  # a new process: nothing to tell
        assert not adoption.taken
    finally:
        for link in links:
            link.close()
        ctx.term()


@pytest.mark.parametrize("adopted", [True, False], ids=["adopted", "not-adopted"])
async def test_an_orphan_given_back_while_its_gateway_is_silent_is_placed_again_once(adopted):
    """A's orphan is preempted on its node while A is silent: its tokens are kept for an
    adopter, and no `Preempted` goes to A now (read when A wakes, it would have A place the
    stream again while B, adopting it, places it too). B adopts it: A is told it was taken.
    Nobody does: A, answering again, gets it back (`Preempted`), and it is no orphan for
    another gateway to adopt any more."""
    ctx = zmq.asyncio.Context()
    a, b = links = _links(ctx, "g-a", "g-b")
    out = _sent(a)
    try:
        node, gateways, adoption = _node(links, "r.0", grace=10.0)
        req = NodeRequest(seq=_seq("r.0", 7, 8))
        a.silent_since = 100.0
        del node.requests["r.0"]  # preempted: off the engine
        adoption.ended(req, "preempted")  # as the runtime's give_back does
        assert adoption.given_back("r.0") and out == []
        if adopted:
            (answer,) = adoption.adopt(Adopt(streams=[("r", 2)]), b)
            assert answer[1].found and answer[1].finish_reason == "preempted"
        assert not adoption.registered(a, "g-a", 101.0)  # A answers again
        a.silent_since = None
        await tell_returned(adoption, a, True)
        if adopted:
            assert out == [Wanted(request_id="r.0", taken=True)]
        else:
            assert out == [Preempted(node_id="node-x", request_id="r.0", reason=FREED)]
            assert adoption.adopt(Adopt(streams=[("r", 2)]), b) == []  # A's again, not B's
            assert not gateways.owners.orphan("r.0")
    finally:
        for link in links:
            link.close()
        ctx.term()


@pytest.mark.parametrize("then", ["silent", "released"])
async def test_a_stream_given_back_to_a_live_gateway_stays_adoptable_if_it_never_hears(then):
    """A's stream is preempted while A still answers: its `Preempted` goes to A. But A may
    be dead, not yet seen silent (heartbeat timeout), or its `Release` (its client left)
    may cross the `Preempted`, which it then drops: either way nobody places it again. Its
    tokens are kept a while: B adopts it (and places it again); A, answering after all, is
    told it was taken."""
    ctx = zmq.asyncio.Context()
    a, b = links = _links(ctx, "g-a", "g-b")
    out = _sent(a)
    try:
        node, gateways, adoption = _node(links, "r.0", grace=10.0)
        req = NodeRequest(seq=_seq("r.0", 7, 8))
        del node.requests["r.0"]  # preempted: off the engine
        runtime = SimpleNamespace(
            control=SimpleNamespace(gateways=gateways, adoption=adoption, push_tokens=a.push),
            metrics=SimpleNamespace(orphans=lambda outcome, n: None),
            node_id="node-x",
        )
        await NodeRuntime.give_back(runtime, "r.0", req, "out of KV blocks")  # type: ignore[arg-type]
        assert out == [Preempted(node_id="node-x", request_id="r.0", reason="out of KV blocks")]
        for _ in range(2):  # heartbeats before A is seen silent: r.0's owner is forgotten
            adoption.sweep(node.load().held)
        if then == "silent":
            a.silent_since = 100.0
            adoption.silenced(a, 100.0)
        else:
            adoption.release("r.0", a, 100.0)
        (answer,) = adoption.adopt(Adopt(streams=[("r", 2)]), b)
        assert answer[1].found and answer[1].finish_reason == "preempted"
        assert answer[1].output_ids == [7, 8]
        if then == "silent":  # A answers again: it forgets the stream B took
            assert not adoption.registered(a, "g-a", 101.0)
            a.silent_since = None
            await tell_returned(adoption, a, True)
            assert out[1:] == [Wanted(request_id="r.0", taken=True)]
    finally:
        for link in links:
            link.close()
        ctx.term()


async def test_an_orphan_whose_kv_is_refused_is_kept_for_its_adopter():
    """A prefill node's orphan (its gateway A silent) whose KV the decode node refuses: its
    NeedDecode went to A, which never answers; it waited "in prefill" for the grace, every
    resume a 409, and was lost. Now its tokens wait for an adopter (finish reason
    "preempted": B places it again) and its KV is freed; a live gateway's asks as before."""
    from pdserve.common.node.handoff import KvHandoff

    ctx = zmq.asyncio.Context()
    a, b = links = _links(ctx, "g-a", "g-b")
    try:
        _, gateways, adoption = _node(links, "r.0", "s.0", grace=10.0)
        aborted: list[str] = []
        sent: list = []

        async def send_gateway(msg) -> None:
            sent.append(msg)

        host = SimpleNamespace(
            requests={r: NodeRequest(seq=_seq(r, 7)) for r in ("r.0", "s.0")},
            control=SimpleNamespace(gateways=gateways, adoption=adoption),
            metrics=SimpleNamespace(orphans=lambda outcome, n: None),
            abort=aborted.append, send_gateway=send_gateway,
        )  # fmt: skip
        host.let_orphan_go = lambda rid: NodeRuntime.let_orphan_go(host, rid)  # type: ignore[arg-type]
        handoff = KvHandoff(host)  # type: ignore[arg-type]
        await handoff.refused("s.0", "decode-0", "KV cache full")  # A answers: asked
        assert [type(m).__name__ for m in sent] == ["NeedDecode"] and aborted == []
        a.silent_since = 100.0
        await handoff.refused("r.0", "decode-0", "KV cache full")
        assert len(sent) == 1 and aborted == ["r.0"]
        (answer,) = adoption.adopt(Adopt(streams=[("r", 1)]), b)
        assert answer[1].found and answer[1].finish_reason == "preempted"
        assert answer[1].output_ids == [7]
    finally:
        for link in links:
            link.close()
        ctx.term()
