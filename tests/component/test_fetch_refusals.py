"""A prefix fetch that cannot go on ends at once on both sides: a fetch header the fetcher's
own intake refuses falls back to computing then (not at its deadline, up to 2 x
--kv-transfer-timeout later), and a holder that cannot start the send refuses it and unpins
(it kept the blocks pinned until its 3 x timeout, and the fetcher heard nothing)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import zmq

from pdserve.common.node.fetch import _Fetch
from pdserve.common.wire.kv_messages import TO_PREFILL_DECODER, KvFetch, KvHeader, KvRefuse
from pdserve.common.wire.protocol import DecodeTarget, encode
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import PARAMS, TIMEOUT, Cluster, outcome, until
from tests.component.test_fetch import fetched


async def _replies(dealer: Any, count: int) -> list[Any]:
    replies = []
    for _ in range(count):
        assert await dealer.poll(int(TIMEOUT * 1000), zmq.POLLIN), "no reply"
        replies.append(TO_PREFILL_DECODER.decode(await dealer.recv()))
    return replies


async def test_a_fetch_header_refused_here_falls_back_at_once(tokenizer):
    """A header from the holder that this node's intake refuses (its layout, an shm segment
    it cannot map) ends the fetch there; one from a third node ends nothing."""
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(PrefillRole, "prefill-0", kv_transfer_timeout=30.0))
        fetches, kv = node.kv.fetches, node.engine.kv_store
        holder = DecodeTarget(node_id="holder-x", data_address="tcp://127.0.0.1:1", host_id="h")
        seq = SimpleNamespace(token_ids=list(range(32)))
        for fid in ("malformed/fetch", "unmapped/fetch", "forged/fetch"):
            fetches.fetching[fid] = _Fetch(fid, seq, holder, 0, 32, [])  # type: ignore[arg-type]
        base = dict(prompt_ids=list(range(32)), num_prompt_tokens=32, params=PARAMS,
                    num_layers=kv.num_layers, frame_bytes=kv.frame_bytes(32),
                    prefill_node="holder-x", fetch=True)  # fmt: skip
        unmapped = {"backend": "shm", "location": "pdserve-seg-holder-x-abcdef-0"}
        headers = [
            ("holder-x", KvHeader(request_id="malformed/fetch", **{**base, "num_layers": 1})),
            ("holder-x", KvHeader(request_id="unmapped/fetch", **{**base, **unmapped})),
            ("peer-z", KvHeader(request_id="forged/fetch", **{**base, "prefill_node": "peer-z"})),
        ]
        dealers = {
            name: make_socket(c.gw.link.ctx, "node.data_out", node.kv.address, identity=name)
            for name in ("holder-x", "peer-z")
        }
        try:
            for name, header in headers:
                await dealers[name].send(encode(header))
            replies = await _replies(dealers["holder-x"], 2)
            replies += await _replies(dealers["peer-z"], 1)
        finally:
            for dealer in dealers.values():
                dealer.close(linger=0)
        assert all(isinstance(r, KvRefuse) for r in replies), replies
        # at once: the fetch's own deadline is 30 s away (it was never even set here)
        await until(lambda: set(fetches.fetching) == {"forged/fetch"}, 2.0, "both fell back")
        assert fetched(node, "fell_back") == 2
        assert node.blocks.num_in_use_blocks == 0  # the unmapped one's reservation freed
        fetches.fetching.clear()


async def test_a_fetch_the_holder_cannot_send_is_refused_and_unpinned_at_once(tokenizer):
    async with Cluster(tokenizer) as c:
        holder = await c.add(c.node(PrefillRole, "prefill-0", kv_transfer_timeout=30.0))
        await c.add(c.node(DecodeRole, "decode-0"))
        prompt = list(range(1000, 1040))
        first = c.request("first", prompt)
        await asyncio.wait_for(c.gw.service.run(first), TIMEOUT)
        assert await outcome(first) == Done("length")
        bm = holder.blocks
        await until(lambda: bm.num_in_use_blocks == 0, what="the first request's blocks freed")
        assert len(bm.match(bm.hashes(prompt[:32]))) == 2  # cached: a fetch finds them

        def cannot(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no way to send")

        holder.kv.sender.begin = cannot  # type: ignore[method-assign]
        me = DecodeTarget(node_id="peer-x", data_address="tcp://127.0.0.1:1", host_id="h")
        ask = KvFetch(request_id="f/fetch", prompt_ids=prompt[:32], skip_tokens=0, reply_to=me)
        dealer = make_socket(c.gw.link.ctx, "node.data_out", holder.kv.address, identity="peer-x")
        try:
            await dealer.send(encode(ask))
            (reply,) = await _replies(dealer, 1)
        finally:
            dealer.close(linger=0)
        assert isinstance(reply, KvRefuse) and reply.request_id == "f/fetch"
        assert "no way to send" in reply.reason
        assert not holder.kv.fetches.serving and bm.num_in_use_blocks == 0
