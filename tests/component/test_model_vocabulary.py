"""Token ids are checked at the gateway against the model's vocabulary, which its nodes say
when they register (`NodeInfo.vocab_size`; the smallest of them), not the tokenizer's: an id
a node would refuse (a model whose vocabulary is smaller than its tokenizer's) is a 400 at
once, not a 503 after the placement timeout; one a padded vocabulary has past the
tokenizer's is served (the sim profiles' is Llama 3.1's, 128256, past SmolLM2's 49152)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.common.engine.sim import SimEngine
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.app import chat_completions, completions
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import SIM, SIM_VOCAB, Cluster, http_front, prompt, until

SMALL = 40_000  # a model vocabulary below the tokenizer's (49152)
BETWEEN = 45_000  # in the tokenizer's vocabulary, not in the model's


def _engine(vocab: int) -> SimEngine:
    engine = SimEngine(SIM)
    engine.model_config = dataclasses.replace(engine.model_config, vocab_size=vocab)
    return engine


def _serve(gw: Any) -> contextlib.AbstractAsyncContextManager[str]:
    """The gateway's two generating endpoints over HTTP: the base URL of its v1 API."""
    return http_front(gw, [web.post("/v1/completions", completions),
                           web.post("/v1/chat/completions", chat_completions)])  # fmt: skip


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        return resp.status, await resp.json()


def _offers(c: Cluster) -> list:
    """The offers the gateway sends from now on (kept, and sent)."""
    sent: list = []
    real = c.gw.placer.send_offer

    async def keep(target: Any, msg: Any) -> None:
        sent.append(msg)
        await real(target, msg)

    c.gw.placer.send_offer = keep
    return sent


async def test_an_id_past_the_models_vocabulary_is_a_400_at_once(tokenizer):
    """Nodes of a model whose vocabulary is smaller than the tokenizer's: a prompt id or a
    stop token id past it (the smallest the nodes said) is refused before any node is
    offered the request. It was offered (the gateway checked the tokenizer's vocabulary),
    every node rejected it, and the client had a 503 after the placement timeout."""
    assert SMALL < BETWEEN < tokenizer.vocab_size
    async with Cluster(tokenizer, placement_timeout=3.0) as c:
        await c.add(c.node(PrefillRole, "prefill-0", engine=_engine(SMALL + 1000)))
        await c.add(c.node(DecodeRole, "decode-0", engine=_engine(SMALL)))
        offers = _offers(c)
        async with _serve(c.gw) as base:
            url = base + "/v1"
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            text = {"prompt": prompt(5), "max_tokens": 2}
            bad = [
                ("/completions", {**text, "prompt": [*prompt(5), BETWEEN]}, "prompt"),
                ("/completions", {**text, "prompt": [SMALL]}, "prompt"),
                ("/completions", {**text, "stop_token_ids": [BETWEEN]}, "stop_token_ids"),
                ("/chat/completions", {**chat, "stop_token_ids": [SMALL]}, "stop_token_ids"),
            ]
            for path, body, param in bad:
                status, data = await _post(url, path, body)
                assert status == 400, (path, body, data)
                assert data["error"]["param"] == param, data
                assert f"[0, {SMALL})" in data["error"]["message"], data
            assert not offers  # refused before placement: no node was asked
            ok = {"prompt": [*prompt(5), SMALL - 1], "max_tokens": 2, "stop_token_ids": [7]}
            status, data = await _post(url, "/completions", ok)
            assert status == 200 and data["usage"]["completion_tokens"] == 2, data
            status, data = await _post(url, "/chat/completions", chat)
            assert status == 200 and data["usage"]["completion_tokens"] == 2, data
            assert len(offers) == 2
        await until(lambda: not c.gw.table, what="every request finished")


async def test_an_id_a_padded_vocabulary_has_past_the_tokenizers_is_served(tokenizer):
    """The sim model's vocabulary is past the tokenizer's: an id between them is one its
    nodes take (and may sample), served, not refused with a 400 as outside the tokenizer's."""
    padded = tokenizer.vocab_size + 1000
    assert padded < SIM_VOCAB
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        async with _serve(c.gw) as base:
            url = base + "/v1"
            body = {"prompt": [*prompt(5), padded], "max_tokens": 2, "stop_token_ids": [padded]}
            status, data = await _post(url, "/completions", body)
            assert status == 200 and data["usage"]["completion_tokens"] == 2, data
            status, data = await _post(url, "/completions", {**body, "prompt": [SIM_VOCAB]})
            assert status == 400 and f"[0, {SIM_VOCAB})" in data["error"]["message"], data
        await until(lambda: not c.gw.table, what="every request finished")
