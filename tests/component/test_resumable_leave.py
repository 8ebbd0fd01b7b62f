"""A resumable stream is kept on its node for a resume only once its client could resume
it: the stream's id reaches the client in its first chunk, so a client that leaves before
any chunk cannot come back, and its request is aborted (KV freed at once), not kept on its
node for `--orphan-grace`."""

from __future__ import annotations

import asyncio

from pdserve.common.config import EngineConfig
from pdserve.common.sampling import SamplingParams
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import Cluster, prompt, until

SLOW = EngineConfig(engine="sim", sim_time_scale=1.0, num_kv_blocks=1024)


async def test_a_resumable_stream_left_before_its_first_chunk_is_aborted_not_kept(tokenizer):
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0", ecfg=SLOW))
        d = await c.add(c.node(DecodeRole, "decode-0", ecfg=SLOW, orphan_grace=60.0))
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=4, ignore_eos=True)
        outcomes = c.gw.metrics.requests
        for i, announced in enumerate((False, True)):
            req = c.request(f"s{i}", prompt(40, 100 * i), params)
            req.resumable, req.announced = True, announced
            run = asyncio.create_task(c.gw.service.run(req))
            await until(lambda r=req: len(r.output_ids) >= 2, what="decoding")
            c.gw.service.end(req)  # the HTTP exchange is over: its client left
            await run
            if not announced:  # no chunk went out: nobody can resume it
                await until(lambda: not d.requests, what="the stream aborted on its node")
                assert outcomes.labels("cancelled")._value.get() == 1
                assert outcomes.labels("detached")._value.get() == 0
                assert not d.control.adoption.finished
        # the one whose client had its id: kept on its node for a resume
        assert outcomes.labels("detached")._value.get() == 1
        await until(lambda: d.control.gateways.owners.orphan(req.wire_id), what="an orphan")
        assert list(d.requests) == [req.wire_id]


async def test_a_stream_left_while_placed_again_is_kept_once_placed(tokenizer):
    """Its client leaves while its stream, given back (preempted), waits to be placed again:
    it has tokens the client may resume from, so it is kept, let go to its new decode node
    once its KV is there (it was aborted: the client's resume found nothing)."""
    async with Cluster(tokenizer, placement_timeout=60.0) as c:
        p = await c.add(c.node(PrefillRole, "prefill-0", ecfg=SLOW))
        d = await c.add(c.node(DecodeRole, "decode-0", ecfg=SLOW, orphan_grace=60.0))
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=4, ignore_eos=True)
        req = c.request("s", prompt(40), params)
        req.resumable = req.announced = True
        run = asyncio.create_task(c.gw.service.run(req))
        await until(lambda: len(req.output_ids) >= 2, what="decoding")
        [(node, task)] = [v for v in c.tasks.values() if v[0] is p]
        await c.stop(node, task)  # no prefill node: the next placement waits
        await until(lambda: "prefill-0" not in c.gw.cluster.nodes, what="prefill-0 gone")
        attempt = c.gw.service.table.current(req)
        c.gw.service.spawn(c.gw.service.replace(attempt, "given back", "preempted"))
        await until(lambda: req.attempt == 1, what="placed again")
        await until(lambda: not d.requests, what="the old attempt aborted on decode-0")
        c.gw.service.end(req)  # its client leaves while it waits for a prefill node
        assert not req.finished
        await c.add(c.node(PrefillRole, "prefill-1", ecfg=SLOW))
        await until(lambda: d.control.gateways.owners.orphan(req.wire_id), what="an orphan")
        outcomes = c.gw.metrics.requests
        assert outcomes.labels("detached")._value.get() == 1
        assert outcomes.labels("cancelled")._value.get() == 0
        assert list(d.requests) == ["s.1"]
        await run  # its first placement was over long ago


async def test_an_acceptance_after_the_client_left_is_no_rejection(tokenizer):
    """The client leaves while its offer is out; the node then accepts. The acceptance is
    aborted there, and it is not the node's refusal: it was counted as a Reject (the
    pdserve:placement_rejects series, the node's room taken as full for the round)."""
    async with Cluster(tokenizer) as c:
        p = await c.add(c.node(PrefillRole, "prefill-0", ecfg=SLOW))
        await c.add(c.node(DecodeRole, "decode-0", ecfg=SLOW))
        req = c.request("s", prompt(40))
        placer, offer = c.gw.placer, c.gw.placer.send_offer

        async def send_then_leave(node, msg) -> None:
            await offer(node, msg)
            c.gw.service.end(req)  # its client leaves before the node's answer is read

        placer.send_offer = send_then_leave
        await c.gw.service.run(req)
        answers = c.gw.metrics.node_messages.labels("Accept")
        await until(lambda: answers._value.get() == 1, what="the node's acceptance")
        await until(lambda: not p.requests, what="the acceptance aborted on the node")
        assert c.gw.metrics.accepts.labels("prefill-0")._value.get() == 0
        assert c.gw.metrics.rejects.labels("prefill-0")._value.get() == 0
        assert c.gw.cluster.nodes["prefill-0"].rejects == 0
