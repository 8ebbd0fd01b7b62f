"""Offers a prefill (or colocated) node cannot take as they are, whoever sends them (a stale
gateway, a peer on the control port): refused with a Reject, never taken into a batch that
then fails (every request of it), nor into a KV transfer that stops the node."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pdserve.colocated_node.server import ColocatedRole
from pdserve.common.wire.protocol import Accept, DecodeTarget, PrefillOffer, Reject
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import PARAMS, SIM, Cluster, prompt, until

SMALL = dataclasses.replace(SIM, max_model_len=128)  # the context: 128 tokens


def _spy(node) -> list:
    sent: list = []
    real = node.send_gateway

    async def send(msg) -> None:
        sent.append(msg)
        await real(msg)

    node.send_gateway = send
    return sent


async def _an_offer(c: Cluster, node, ids: list[int]) -> PrefillOffer:
    """The gateway's offer of a request served to its end (a template for others)."""
    offers: list[PrefillOffer] = []
    real = c.gw.placer.send_offer

    async def keep(target, msg) -> None:
        offers.append(msg)
        await real(target, msg)

    c.gw.placer.send_offer = keep
    ok = c.request("ok", ids)
    await c.gw.service.run(ok)
    await until(lambda: ok.finished and not node.requests, what="a first request's end")
    c.gw.placer.send_offer = real
    return offers[0]


@pytest.mark.parametrize("role", [PrefillRole, ColocatedRole])
async def test_an_offer_past_the_context_or_the_vocabulary_is_refused(tokenizer, role):
    """A prompt the node's context cannot hold (a node that joined with a smaller
    --max-model-len than the one the gateway validated against), a token id past the
    vocabulary, an empty prompt, a prompt_len or decode_cached that is no length of the
    prompt: each a Reject. They were accepted: an engine step failed (and on a GPU, a
    device assert failed every step after it), or the colocated node exited."""
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(role, f"{role.role}-0", ecfg=SMALL))
        await c.add(c.node(DecodeRole, "decode-0"))
        good = await _an_offer(c, node, prompt(20))
        vocab = node.engine.model_config.vocab_size
        sent = _spy(node)
        bad = {
            "long": {"prompt_ids": prompt(128)},
            "vocabulary": {"prompt_ids": [*prompt(10), vocab]},
            "negative": {"prompt_ids": [-1, *prompt(10)]},
            "empty": {"prompt_ids": []},
            "prompt_len": {"prompt_len": 21},
            "decode_cached": {"decode_cached": -16},
        }
        for rid, fields in bad.items():
            offer = msgspec.structs.replace(good, request_id=rid, **fields)
            await node.role.on_gateway_message(offer)
        await until(lambda: len(sent) == len(bad), what="every answer")
        assert all(isinstance(m, Reject) for m in sent), sent
        assert not node.stopped.is_set() and not node.requests
        req = c.request("after", prompt(20, 500), PARAMS)  # the node serves on
        await c.gw.service.run(req)
        await until(lambda: req.finished, what="a request after them")
        assert len(req.output_ids) == PARAMS.max_tokens


async def test_a_decode_cached_that_is_no_whole_block_here_does_not_stop_the_node(tokenizer):
    """decode_cached counts the decode node's blocks (its own block size: nodes may differ);
    one that is not whole blocks of the prefill node's failed an assertion in the step
    loop's hook, which stopped the node. Rounded down to whole blocks here."""
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        good = await _an_offer(c, node, prompt(40))
        sent = _spy(node)
        offer = msgspec.structs.replace(good, request_id="odd.0", decode_cached=8)
        await node.role.on_gateway_message(offer)
        await until(lambda: any(isinstance(m, Accept) for m in sent), what="the acceptance")
        await until(lambda: "odd.0" not in node.requests, what="the request's end")
        assert not node.stopped.is_set()
        req = c.request("after", prompt(20, 500), PARAMS)
        await c.gw.service.run(req)
        await until(lambda: req.finished, what="a request after it")


async def test_a_decode_node_refuses_a_local_prefill_it_cannot_take(tokenizer):
    """A decode node asked to prefill a request itself (--local-prefill): the same checks.
    An empty prompt or a token id past the vocabulary reached its engine step, which stops
    a decode node (and every stream on it)."""
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        node = await c.add(c.node(DecodeRole, "decode-0", ecfg=SMALL))
        sent = _spy(node)
        target = DecodeTarget(node_id="decode-0", data_address="", host_id="h")
        vocab = node.engine.model_config.vocab_size
        bad = {"empty": [], "vocabulary": [*prompt(10), vocab], "long": prompt(128)}
        for rid, ids in bad.items():
            offer = PrefillOffer(request_id=rid, prompt_ids=ids, params=PARAMS, decode=target)
            await node.role.on_gateway_message(offer)
        await until(lambda: len(sent) == 3, what="every answer")
        assert all(isinstance(m, Reject) for m in sent), sent
        assert not node.stopped.is_set() and not node.requests
