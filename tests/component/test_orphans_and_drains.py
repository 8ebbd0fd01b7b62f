"""Orphans and drains on a decode node that serves two gateways (scripted, tests/component/
test_gateways.py): a stream parked for a move its dead gateway never ordered decodes on for
its adopter; a draining node decodes its orphans rather than park them; Drain is taken once,
from the leader; a node with no gateway left drains and exits."""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.common.wire.kv_messages import TO_DECODE_DECODER, KvHeader, KvRefuse
from pdserve.common.wire.protocol import (
    Adopt,
    Adopted,
    DecodeTarget,
    Drain,
    Migrate,
    Rebalance,
    Redirect,
    encode,
)
from pdserve.common.wire.security import close_context, make_context
from pdserve.common.wire.transport import free_port, make_socket
from tests.component.cluster import TIMEOUT, until
from tests.component.test_gateways import _streaming_for_a


async def test_a_stream_parked_for_a_move_its_gateway_never_ordered_decodes_for_its_adopter(
    tokenizer,
):
    """The leading gateway A orders a rebalance: the decode node parks r.0 and asks A where
    it goes (Migrate); A dies before it answers. B adopts the orphan, and it decodes on for
    B. Before, it was handed over still parked: no token ever again, its blocks held."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        await a.tell(d, Rebalance(request_ids=("r.0",)))
        await until(lambda: [m for m in a.inbox if isinstance(m, Migrate)], what="parked")
        assert "r.0" in d.scheduler.parked
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.finish_reason is None
        made = len(adopted.output_ids)
        await until(lambda: len(b.streamed["r.0"]) >= 3, what="tokens to B")
        assert min(b.streamed["r.0"]) == made and "r.0" not in d.scheduler.parked


async def test_a_draining_node_decodes_its_orphans_on_rather_than_park_them(tokenizer):
    """A drain moves running sequences by asking their gateway where (Migrate); an orphan's
    gateway is gone, so it was parked for an answer that never came (decoding nothing until
    the drain timed out)."""
    async with _streaming_for_a(tokenizer) as (a, _, d):
        d.cfg = dataclasses.replace(d.cfg, drain_migrate="on")
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        made = len(d.requests["r.0"].seq.output_ids)
        d.control.begin_drain()
        await until(lambda: len(d.requests["r.0"].seq.output_ids) >= made + 3, what="decoding")
        assert "r.0" not in d.scheduler.parked and d.metrics.migrations._value.get() == 0


async def test_a_draining_node_s_orphan_whose_move_is_refused_decodes_on(tokenizer):
    """A names where r.0 goes (the drain's Migrate answered) and goes silent while its KV is
    on the way; the target then refuses it. No gateway reads a NeedDecode: the orphan was
    given back (its KV freed, to be recomputed by its adopter), though it could decode on
    here as the orphans a drain never moves do, for an adopter to resume where it is."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="on",
                                                    drain_timeout=30.0)  # fmt: skip
        ctx = make_context(None)
        address = f"tcp://127.0.0.1:{free_port()}"
        target = make_socket(ctx, "node.data", address)  # the data socket of a decode node
        try:
            d.control.begin_drain()
            await until(lambda: [m for m in a.inbox if isinstance(m, Migrate)], what="a move")
            to = DecodeTarget(node_id="decode-1", data_address=address, host_id="elsewhere")
            await a.tell(d, Redirect(request_id="r.0", decode=to))
            peer, payload, *_ = await asyncio.wait_for(target.recv_multipart(), TIMEOUT)
            assert isinstance(TO_DECODE_DECODER.decode(payload), KvHeader)  # on its way
            a.muted = True
            await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
            req = d.requests["r.0"]
            made = len(req.seq.output_ids)
            refuse = KvRefuse(request_id="r.0", reason="KV cache full")
            await target.send_multipart([peer, encode(refuse)])
            await until(lambda: "r.0" not in d.sender.transfers, what="the refusal read")
            assert d.requests.get("r.0") is req and req.target is None  # not given back
            await until(lambda: len(req.seq.output_ids) >= made + 3, what="decoding on")
            assert "r.0" not in d.control.adoption.finished and "r.0" not in d.scheduler.parked
            await b.tell(d, Adopt(streams=[("r", 0)]))
            await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="adopted")
            adopted = next(m for m in b.inbox if isinstance(m, Adopted))
            assert adopted.found and adopted.finish_reason is None  # running: not recomputed
            assert len(adopted.output_ids) >= made + 3
        finally:
            target.close()
            close_context(ctx)


async def test_a_node_takes_one_drain_from_its_leader_only(tokenizer):
    """Drain from a gateway that does not lead is ignored, and a second Drain no longer stops
    the node at once (it was taken for a second SIGTERM: nothing handed back)."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = dataclasses.replace(d.cfg, drain_migrate="off")
        await b.tell(d, Drain())
        held = len(a.streamed["r.0"])
        await until(lambda: len(a.streamed["r.0"]) >= held + 2, what="more tokens")
        assert not d.control.draining
        await a.tell(d, Drain())
        await a.tell(d, Drain())
        await until(lambda: d.control.draining, what="draining")
        held = len(a.streamed["r.0"])
        await until(lambda: len(a.streamed["r.0"]) >= held + 2, what="decoding on")
        assert not d.stopped.is_set()


async def test_a_node_with_no_gateway_left_drains_and_exits(tokenizer):
    """Every gateway silent, then SIGTERM: the drain's hand-back waited for a registration
    that never came, and the node never exited."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="off",
                                                    drain_timeout=1.0)  # fmt: skip
        a.muted = b.muted = True
        await until(lambda: not d.control.registered.is_set(), what="no gateway left")
        d.control.begin_drain()
        await until(d.stopped.is_set, 10.0, "the drain's end")


async def test_a_draining_node_waits_for_its_ended_orphans_adopter(tokenizer):
    """A's stream ended here as an orphan (given back: its tokens kept for a resume), then
    the node drains. It no longer exits at once, the tokens with it (the client's resume
    found nothing): it waits, up to --drain-timeout, until they are adopted."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_timeout=60.0)
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        await d.hand_back("draining")
        await until(lambda: "r.0" not in d.requests, what="given back")
        assert "r.0" in d.control.adoption.finished
        checks: list[bool] = []
        idle = d.idle
        d.idle = lambda: checks.append(idle()) or checks[-1]  # type: ignore[method-assign]
        d.control.begin_drain()
        await until(lambda: len(checks) >= 3, what="the drain to look thrice")
        assert not d.stopped.is_set() and not any(checks)
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.finish_reason == "preempted"
        await until(d.stopped.is_set, 10.0, "the drain's end")


async def test_a_running_orphan_adopted_while_its_node_drains_moves_on(tokenizer):
    """A draining node decodes an orphan on (no gateway to ask where it goes); once adopted,
    it has one: moved on like the others (Migrate to its adopter), not decoded here until
    the drain's timeout hands it back for recompute."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="on")
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        d.control.begin_drain()
        await until(lambda: not d.role.to_park, what="the drain's move skipped (an orphan)")
        made = len(d.requests["r.0"].seq.output_ids)
        await until(lambda: len(d.requests["r.0"].seq.output_ids) > made, what="decoding on")
        assert "r.0" not in d.scheduler.parked
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        assert next(m for m in b.inbox if isinstance(m, Adopted)).found
        await until(lambda: [m for m in b.inbox if isinstance(m, Migrate)], what="a move")
        assert "r.0" in d.scheduler.parked


async def test_a_gateway_dead_during_a_drain_leaves_its_streams_adoptable_and_the_lead(
    tokenizer,
):
    """The leader A orders a drain and goes silent during it: a draining node never took A
    for silent, so A's streams could be adopted nowhere (Adopt answered "live gateway") and
    the node named A its leader until the drain's end, so no gateway led the pool care."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="off",
                                                    drain_timeout=30.0)  # fmt: skip
        assert d.control.gateways.leader() == "gw-a"
        await a.tell(d, Drain())
        await until(lambda: d.control.draining, what="draining")
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        assert d.control.gateways.leader() == "gw-b"
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.request_id == "r.0", adopted
        made = len(adopted.output_ids)
        await until(lambda: len(b.streamed["r.0"]) >= 3, what="tokens to B")
        assert min(b.streamed["r.0"]) == made


async def test_a_gateway_paused_during_a_drain_gets_its_node_and_streams_back(tokenizer):
    """Silent past the node's heartbeat timeout while the node drains, then answering as
    the same process: the node knocks (Register) as when serving, so A has its node and its
    stream back; not knocking, its streams stayed orphans and were freed at the grace."""
    async with _streaming_for_a(tokenizer) as (a, _, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="off",
                                                    drain_timeout=30.0)  # fmt: skip
        await a.tell(d, Drain())
        await until(lambda: d.control.draining, what="draining")
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        a.muted = False
        await until(lambda: d.control.links[0].silent_since is None, what="A back")
        assert d.control.links[0].registered and d.control.gateways.leader() == "gw-a"
        held = len(a.streamed["r.0"])
        await until(lambda: len(a.streamed["r.0"]) >= held + 3, what="r.0 on, to A")
        assert d.control.draining and "r.0" in d.requests


async def test_a_gateway_restarted_during_a_drain_gets_the_node_back_and_its_streams_orphaned(
    tokenizer,
):
    """A restarts within the node's heartbeat timeout while the node drains: it answers the
    node's beats "unknown node". A draining node took no notice: it never registered again,
    so never learned A's new id, and A's old streams were no orphans (adoptable nowhere:
    "live gateway") for the whole drain."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="off",
                                                    drain_timeout=30.0)  # fmt: skip
        await a.tell(d, Drain())
        await until(lambda: d.control.draining, what="draining")
        a.restart("gw-a2")
        link = d.control.links[0]
        await until(lambda: link.gateway_id == "gw-a2", 3.0, "registered with the new A")
        assert link.silent_since is None  # it never went silent: it answered every beat
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.request_id == "r.0", adopted
        assert d.control.draining


async def test_a_draining_node_refused_by_a_restarted_gateway_drains_on(tokenizer):
    """Registering again while draining (a restarted gateway), a refusal (the gateway now
    started with another --model, say) stopped the node at once: its streams, which its
    drain was to finish or hand back, were lost. It logs the refusal and drains on."""
    async with _streaming_for_a(tokenizer) as (a, _, d):
        d.cfg = d.control.cfg = dataclasses.replace(d.cfg, drain_migrate="off",
                                                    drain_timeout=30.0)  # fmt: skip
        await a.tell(d, Drain())
        await until(lambda: d.control.draining, what="draining")
        a.refuses["decode-0"] = "start both with the same --model"
        a.restart("gw-a2")
        await until(lambda: "decode-0" in a.refused, 3.0, "the node refused by the new A")
        held = len(a.streamed["r.0"])
        await until(lambda: len(a.streamed["r.0"]) >= held + 3, what="r.0 decoded on")
        assert d.control.links[0].refused and not d.control.stopped.is_set()
        assert d.control.draining and "r.0" in d.requests
        # asked once: not again at every beat it answers "unknown node" to
        beats = len([b for b in a.beats if b.node_id == "decode-0"])
        await until(lambda: len([b for b in a.beats if b.node_id == "decode-0"]) >= beats + 3,
                    what="three more beats")  # fmt: skip
        assert a.refused.count("decode-0") == 1, a.refused
