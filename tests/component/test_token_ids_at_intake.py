"""Token ids from a peer's data socket are held to the model's vocabulary before anything
hashes them. msgpack carries any int up to 2**64 - 1: a KV header whose prompt held one past
2**63 was reserved and admitted, its prefix hash failed (struct.error) in the scheduler, no
KvAck went, and the next step failed outside the step loop's guard (the decode node
stopped); a prefix fetch asking for such a prompt failed its serving task, answered by
nothing (the fetcher waited for its deadline). Both are refused at once now."""

from __future__ import annotations

import asyncio

from pdserve.common.wire.kv_messages import KvFetch, KvHeader, KvRefuse
from pdserve.common.wire.protocol import DecodeTarget, encode
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import PARAMS, SIM_VOCAB, TIMEOUT, Cluster, outcome
from tests.component.test_fetch_refusals import _replies

BAD = (2**63, 2**64 - 1, SIM_VOCAB, -1)  # msgpack: uint64, uint64, past the model, negative


async def test_a_kv_header_with_a_token_id_outside_the_vocabulary_is_refused(tokenizer):
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(DecodeRole, "decode-0"))
        kv = node.engine.kv_store
        dealer = make_socket(c.gw.link.ctx, "node.data_out", node.kv.address, identity="p-x")
        try:
            for i, bad in enumerate(BAD):
                prompt = [bad, *range(40)]  # in the first block: hashed at once
                header = KvHeader(request_id=f"bad{i}.0", prompt_ids=prompt, num_prompt_tokens=41,
                                  params=PARAMS, num_layers=kv.num_layers,
                                  frame_bytes=kv.frame_bytes(41), prefill_node="p-x")  # fmt: skip
                await dealer.send(encode(header))
                (reply,) = await _replies(dealer, 1)
                assert isinstance(reply, KvRefuse) and reply.request_id == f"bad{i}.0"
                assert reply.reason == f"a token id outside the vocabulary (0 to {SIM_VOCAB - 1})"
        finally:
            dealer.close(linger=0)
        assert node.blocks.num_in_use_blocks == 0 and not node.kv.intake.incoming
        await c.add(c.node(PrefillRole, "prefill-0"))
        req = c.request("after", list(range(100, 140)))  # the node decodes on
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")


async def test_a_fetch_of_a_token_id_outside_the_vocabulary_is_refused(tokenizer):
    async with Cluster(tokenizer) as c:
        holder = await c.add(c.node(PrefillRole, "prefill-0"))
        me = DecodeTarget(node_id="peer-x", data_address="tcp://127.0.0.1:1", host_id="h")
        dealer = make_socket(c.gw.link.ctx, "node.data_out", holder.kv.address, identity="peer-x")
        try:
            for i, bad in enumerate(BAD):
                ids = [bad, *range(31)]
                await dealer.send(encode(KvFetch(request_id=f"f{i}/fetch", prompt_ids=ids,
                                                 skip_tokens=0, reply_to=me)))  # fmt: skip
                (reply,) = await _replies(dealer, 1)
                assert isinstance(reply, KvRefuse) and reply.request_id == f"f{i}/fetch"
                assert "outside the vocabulary" in reply.reason
        finally:
            dealer.close(linger=0)
        assert not holder.kv.fetches.serving and holder.blocks.num_in_use_blocks == 0
