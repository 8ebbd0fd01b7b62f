"""A decode node that leaves while a request's offers are out (gateway/placement.py): the
round planned its (prefill, decode) pairs before an unanswered offer took the offer timeout,
or before the node's Accept came back. Placed on the node that left, the request would wait
on a node nobody watches (its leaving re-placed only what it held then): its client's stream
hung after the first token (found by the node-fault chaos test). Real gateway and sim nodes
over ZeroMQ, in one event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.common.wire.protocol import PrefillOffer
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, outcome, prompt, until


def _offers(node: Any, answer: bool = True) -> list[tuple[str, str]]:
    """(wire id, decode node id) of every offer `node` gets; `answer` False: it never
    answers them (a node frozen for their timeout)."""
    seen: list[tuple[str, str]] = []
    on_offer = node.role._on_offer

    async def recorded(offer: PrefillOffer) -> None:
        seen.append((offer.request_id, offer.decode.node_id))
        if answer:
            await on_offer(offer)

    node.role._on_offer = recorded
    return seen


async def _replace_decode(c: Cluster, gone: Any) -> None:
    """`gone` leaves (the gateway drops it) and decode-2 registers."""
    await c.stop(gone, next(t for n, t in c.tasks.values() if n is gone))
    await until(lambda: gone.node_id not in c.gw.cluster.nodes, what="decode-1 dropped")
    await c.add(c.node(DecodeRole, "decode-2"))
    await until(lambda: c.gw.cluster.nodes["decode-2"].load.blocks_free > 0, what="a report")


async def test_no_offer_names_a_decode_node_that_left_during_an_unanswered_one(tokenizer):
    """prefill-a never answers; the round's next pair, (prefill-b, decode-1), was planned
    before decode-1 left during prefill-a's offer timeout: it is not offered, the request is
    placed on decode-2 and completes."""
    # the node's leaving and decode-2's first report must fit in prefill-a's offer timeout:
    # ~0.2 s idle on 2 vCPUs, so 3 s holds on a host 10x slower
    async with Cluster(tokenizer, offer_timeout=3.0, placement_timeout=10.0) as c:
        silent = _offers(await c.add(c.node(PrefillRole, "prefill-a")), answer=False)
        answering = await c.add(c.node(PrefillRole, "prefill-b"))
        seen = _offers(answering)
        leaving = await c.add(c.node(DecodeRole, "decode-1"))
        req = c.request("r", prompt(40))
        run = asyncio.create_task(c.gw.service.run(req))
        await until(lambda: bool(silent), what="the offer to prefill-a")
        assert silent[0][1] == "decode-1"  # the pairs of this round name decode-1
        await _replace_decode(c, leaving)
        assert not silent[1:] and not seen  # all within prefill-a's offer timeout
        await asyncio.wait_for(run, 10.0)
        assert await outcome(req, 5.0) == Done("length")
        assert all(decode == "decode-2" for _, decode in seen), seen
        assert req.ran_on["decode"] == "decode-2"
        await until(lambda: not c.gw.table and not answering.requests, 2.0, "all ended")


async def test_an_accept_naming_a_decode_node_that_left_is_aborted_and_placed_again(tokenizer):
    """prefill-b answers the offer naming decode-1 only after decode-1 has left: its Accept
    is aborted there, the request goes on under a new wire id, placed on decode-2."""
    # the late Accept must come before the offer times out: decode-1's leaving and
    # decode-2's registering take ~0.2 s idle on 2 vCPUs
    async with Cluster(tokenizer, offer_timeout=5.0, placement_timeout=10.0) as c:
        node = await c.add(c.node(PrefillRole, "prefill-b"))
        leaving = await c.add(c.node(DecodeRole, "decode-1"))
        on_offer, held = node.role._on_offer, asyncio.Event()
        seen: list[tuple[str, str]] = []

        async def late(offer: PrefillOffer) -> None:  # the first offer answered late
            seen.append((offer.request_id, offer.decode.node_id))
            if len(seen) == 1:
                held.set()
                await until(lambda: "decode-2" in c.gw.cluster.nodes, what="decode-2")
            await on_offer(offer)

        node.role._on_offer = late
        req = c.request("r", prompt(40))
        run = asyncio.create_task(c.gw.service.run(req))
        await asyncio.wait_for(held.wait(), 5.0)
        await _replace_decode(c, leaving)
        await asyncio.wait_for(run, 10.0)
        assert await outcome(req, 5.0) == Done("length")
        assert [d for _, d in seen] == ["decode-1", "decode-2"], seen
        assert seen[0][0] != seen[1][0]  # the aborted acceptance's wire id is spent
        assert req.ran_on["decode"] == "decode-2"
        await until(lambda: not c.gw.table and not node.requests, 2.0, "all ended")
        assert node.blocks.num_in_use_blocks == 0  # the aborted acceptance freed its KV
