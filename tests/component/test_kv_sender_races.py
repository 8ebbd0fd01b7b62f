"""Races between the KV sender's threads and the event loop, and the intake's own loop: a
transfer released while a worker stages it keeps its shm segment until the stage ends, and
nothing of it is sent after; a fetch being served holds up no other transfer."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import zmq

from pdserve.common.engine.sequence import Sequence
from pdserve.common.kv import sender as sender_module
from pdserve.common.kv import tcp_send
from pdserve.common.kv.sender import TransferEnded
from pdserve.common.node.handoff import KvHandoff
from pdserve.common.node.role import NodeRequest
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import KvFetch
from pdserve.common.wire.protocol import encode
from tests.component.cluster import until
from tests.component.test_kv_backends import LAYOUT, Pair, digest


async def test_a_transfer_released_mid_stage_keeps_its_segment_till_the_stage_ends():
    """A fetch served or a resend stages off the event loop; released meanwhile (refused,
    aborted), its shm segment went back to the pool at once, the next transfer was lent it,
    and the stale stage wrote its layer into that transfer's frames."""
    pair = await Pair("shm", 64).start()
    try:
        store, entered, go = pair.src.kv_store, asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        export = store.export_into

        def slow_export(layer, table, n, view):  # the first transfer's first layer waits
            if table == [0, 1] and layer == 0:
                loop.call_soon_threadsafe(entered.set)
                asyncio.run_coroutine_threadsafe(go.wait(), loop).result()
                view[:] = b"\xab" * len(view)  # what a stale stage writes
                return
            export(layer, table, n, view)

        store.export_into = slow_export
        t1 = pair.sender.begin("a", pair.target, list(range(20)), 20, SamplingParams(), [0, 1])
        staging = asyncio.create_task(asyncio.to_thread(pair.sender.stage_all, t1))
        await entered.wait()
        segment = t1.state
        pair.sender.abort("a")  # released while its stage runs
        t2 = pair.sender.begin("b", pair.target, list(range(20)), 20, SamplingParams(), [2, 3])
        assert t2.state is not segment  # not lent while a stage writes into it
        pair.sender.push_all(t2, pair.sender.stage_all(t2))
        before = bytes(t2.state.view(0, t2.total_bytes))
        go.set()
        with pytest.raises(TransferEnded):  # its next layer: not staged
            await staging
        outbox = pair.sender.peers["d"].outbox.qsize()
        pair.sender.push(t1, 0, None)  # a push or done of it after its release: nothing sent
        pair.sender.done(t1, 1)
        assert pair.sender.peers["d"].outbox.qsize() == outbox
        assert bytes(t2.state.view(0, t2.total_bytes)) == before
        pool = pair.sender.connector("shm").pool
        # aborted: destroyed once the stage ended, never lent again (test_shm_segments.py)
        await until(lambda: segment not in pool.all, 5.0, "the segment destroyed")
        pair.sender.done(t2, 1)
        landed = await asyncio.wait_for(pair.admitted.get(), 10)
        assert digest(pair.dst, landed.block_table, 20) == digest(pair.src, [2, 3], 20)
    finally:
        await pair.close()


async def test_a_fetch_being_served_holds_up_no_other_transfer():
    """A peer's KvFetch was served inline on the intake's loop: while a large prefix was
    staged, no frame, KvDone or Abort of any other transfer to this node was read (stall
    timeouts, redirected requests)."""
    pair = await Pair("zmq", 64).start()
    try:
        release = asyncio.Event()
        served: list[str] = []

        async def serve(peer: bytes, msg) -> None:
            served.append(msg.request_id)
            await release.wait()  # a stage that takes long

        pair.intake.on_fetch = serve
        fetch = KvFetch(request_id="f", prompt_ids=list(range(32)), skip_tokens=0,
                        reply_to=pair.target)  # fmt: skip
        handled = pair.intake.handle([zmq.Frame(b"peer"), zmq.Frame(encode(fetch))])
        await asyncio.wait_for(handled, 2.0)  # returned while the fetch is still served
        await until(lambda: served == ["f"], 5.0, "the fetch's serving to start")
        landed = await pair.send("r", 40, list(range(3)), layerwise=False)  # meanwhile
        assert digest(pair.dst, landed.block_table, 40) == digest(pair.src, list(range(3)), 40)
        release.set()
        await until(lambda: not pair.intake.serving, 5.0, "the fetch served")
    finally:
        await pair.close()


async def test_a_direct_write_whose_transfer_ends_mid_copy_is_never_announced():
    """shm_direct copies from the sender's blocks in a thread; the request dropped during
    the copy frees those blocks, and another pass may write into them before the copy ends.
    That layer must not be announced as landed (the receiver then refuses the transfer at
    its KvDone, and caches nothing from it); it was, and the torn KV was admitted."""
    pair = await Pair("shm_direct", capacity=600).start()
    connector = pair.sender.connector("shm_direct")
    real_copy = connector.copy
    try:
        n, table = 40, [0, 1, 2]
        t = pair.sender.begin("torn", pair.target, list(range(n)), n, SamplingParams(), table)
        assert t.backend == "shm_direct"
        last = t.num_layers - 1

        def copy_then_drop(own, tr, layer, dst, blocks, mark):
            real_copy(own, tr, layer, dst, blocks, mark)
            if layer == last:  # the abort lands while the last layer is being copied
                tr.state.closed = True

        connector.copy = copy_then_drop
        for layer in range(t.num_layers):
            pair.sender.push(t, layer, pair.sender.stage(t, layer))
        pair.sender.done(t, 1)
        await until(lambda: bool(pair.refusals), 5.0, "the receiver refuses it")
        assert pair.refusals == [f"got {last}/{t.num_layers} layers"]
        assert pair.admitted.empty()
        pair.sender.release("torn")
        connector.copy = real_copy
        ok = await pair.send("after", n, [5, 6, 7], layerwise=True)
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, [5, 6, 7], n)
    finally:
        connector.copy = real_copy
        await pair.close()


async def test_an_ended_tcp_transfer_sends_no_kv_done_after_a_frame_read_its_freed_blocks(
    monkeypatch,
):
    """A transfer's KvDone goes only once its frames are out of their views (written to the
    tcp stream, or taken by ZeroMQ), and not at all if it ended meanwhile. It ran ahead of up
    to two frames: a request dropped while its last frame was being written freed blocks the
    frame still read, the next pass wrote into them, and the decode node admitted the torn
    layer (and cached it under the prompt's hashes)."""
    pair = await Pair("tcp", capacity=600).start()
    held, go = threading.Event(), threading.Event()
    real = tcp_send.send_views
    frames = {"n": 0}

    def last_held(sock, views):
        frames["n"] += 1
        if frames["n"] == LAYOUT.num_layers:  # the last layer's frame, its views not read
            held.set()
            go.wait(10)
        real(sock, views)

    monkeypatch.setattr(tcp_send, "send_views", last_held)
    try:
        n, table = 40, [0, 1, 2]
        t = pair.sender.begin("torn", pair.target, list(range(n)), n, SamplingParams(), table)
        for layer in range(t.num_layers):
            pair.sender.push(t, layer, pair.sender.stage(t, layer))
        pair.sender.done(t, 1)
        await asyncio.to_thread(held.wait, 10)
        # the request dropped: its transfer ends, its blocks go to a pass that writes them;
        # its Abort, on ZeroMQ, may be read after the frame lands (released here: none sent)
        pair.sender.release("torn")
        pair.src.cache.data.zero_()
        go.set()
        # behind every message and frame before it: once it is in, the torn frame landed
        # and any KvDone sent for it was read
        ok = await pair.send("after", n, [5, 6, 7], layerwise=True)
        assert ok.header.request_id == "after", "the torn transfer was admitted"
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, [5, 6, 7], n)
        torn = pair.intake.incoming["torn"]
        assert len(torn.layers) == t.num_layers and torn.first_token is None  # no KvDone
    finally:
        go.set()
        await pair.close()


async def test_frames_that_never_leave_end_their_transfer_as_refused(monkeypatch):
    """ZeroMQ holds a transfer's zero-copy frames for a peer that reads nothing: after the
    timeout its KvDone is not sent, and the transfer ends as if refused (the prefill node asks
    the gateway for another decode node); it was left waiting, its blocks held."""
    pair = await Pair("zmq", capacity=600).start()
    monkeypatch.setattr(sender_module, "_wait_all", lambda trackers, timeout: False)
    try:
        n, table = 40, [0, 1, 2]
        t = pair.sender.begin("stuck", pair.target, list(range(n)), n, SamplingParams(), table)
        parts = pair.sender.stage(t, 0)
        t.trackers.append(SimpleNamespace(done=False))  # a frame ZeroMQ still holds
        pair.sender.push(t, 0, parts)
        pair.sender.done(t, 1)
        await until(lambda: bool(pair.refusals), 5.0, "the transfer ends")
        assert pair.refusals == ["KV frames not out in time"] and pair.admitted.empty()
    finally:
        await pair.close()


async def test_a_transfer_refused_twice_asks_the_gateway_once(monkeypatch):
    """Its frames stuck (our refusal, at the timeout) and then the decode node's own refusal:
    each asked the gateway for another decode node, and the second Redirect abandoned the
    transfer the first had begun."""
    pair = await Pair("zmq", capacity=600).start()
    monkeypatch.setattr(sender_module, "_wait_all", lambda trackers, timeout: False)
    try:
        t = pair.sender.begin("stuck", pair.target, list(range(40)), 40, SamplingParams(),
                              [0, 1, 2])  # fmt: skip
        t.trackers.append(SimpleNamespace(done=False))  # a frame ZeroMQ still holds
        pair.sender.push(t, 0, pair.sender.stage(t, 0))
        pair.sender.done(t, 1)
        await until(lambda: bool(pair.refusals), 5.0, "the transfer ends")
        pair.sender.begin("other", pair.target, list(range(20)), 20, SamplingParams(), [3, 4])
        await pair.intake.refuse(b"p", "stuck", "no progress")  # the decode node's, late
        await pair.intake.refuse(b"p", "other", "behind it")  # read after it, in order
        await until(lambda: "behind it" in pair.refusals, 5.0, "both refusals read")
        assert pair.refusals == ["KV frames not out in time", "behind it"]
    finally:
        await pair.close()


async def test_a_redirect_while_a_transfer_is_unanswered_aborts_it_or_is_a_repeat():
    """A Redirect naming the target of a transfer still unanswered is the one that began it
    (sent twice): that transfer goes on. One elsewhere (or to nobody) let it go without a
    word to its target, whose reservation stayed until its own timeout."""
    pair = await Pair("zmq", capacity=600).start()
    try:
        seq = Sequence.new("m.0", list(range(20)), SamplingParams(max_tokens=8))
        seq.token_ids.append(9)
        seq.block_table = [0, 1]
        req = NodeRequest(seq=seq)

        async def out_of_step(rid: str) -> None:
            return None

        parked = SimpleNamespace(parked={"m.0": seq})
        node = SimpleNamespace(requests={"m.0": req}, scheduler=parked, sender=pair.sender,
                               steps=SimpleNamespace(out_of_step=out_of_step),
                               gateway_of=lambda rid: "")  # fmt: skip
        handoff = KvHandoff(node, keep=lambda rid: True)  # type: ignore[arg-type]
        free = len(pair.free)
        t = pair.sender.begin("m.0", pair.target, seq.token_ids[:-1], 20, seq.params, [0, 1])
        await until(lambda: "m.0" in pair.intake.incoming, 5.0, "the target reserves")
        await handoff.send_kv("m.0", pair.target)  # the same Redirect again
        assert pair.sender.transfers.get("m.0") is t
        await handoff.send_kv("m.0", None)  # nobody: kept here, the target told
        assert "m.0" not in pair.sender.transfers and req.target is None
        await until(lambda: len(pair.free) == free, 2.0, "the target's reservation dropped")
        assert "m.0" not in pair.intake.incoming
    finally:
        await pair.close()
