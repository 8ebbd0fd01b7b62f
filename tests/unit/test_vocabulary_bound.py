"""The token ids the gateway takes are those below the model's vocabulary, the smallest its
nodes said at registration (`NodeInfo.vocab_size`), the tokenizer's while none said (older
nodes); a stream resumed from a node is held to it too (HTTP: the component test
tests/component/test_model_vocabulary.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Adopted
from pdserve.gateway.cluster import TOKEN_ID_LIMIT, ClusterView
from pdserve.gateway.openai_api import ApiError
from pdserve.gateway.stream_state import Position
from tests.unit.test_resume_rounds import ID, _Link, _resumes, _until
from tests.unit.test_several_gateways import _info

TOKENIZER = 49_152  # SmolLM2's


def test_the_smallest_vocabulary_a_node_said_bounds_the_ids_else_the_tokenizers():
    cluster = ClusterView(heartbeat_timeout=2.0)
    assert cluster.vocab_size(TOKENIZER) == TOKENIZER  # no node
    assert cluster.register(_info("older"), b"older", 0.0, "t") is None  # says none (0)
    assert cluster.vocab_size(TOKENIZER) == TOKENIZER
    for node_id, vocab in (("padded", 128_256), ("small", 40_000)):
        info = msgspec.structs.replace(_info(node_id), vocab_size=vocab)
        assert cluster.register(info, node_id.encode(), 0.0, "t") is None
    assert cluster.vocab_size(TOKENIZER) == 40_000
    cluster.remove("small")
    assert cluster.vocab_size(TOKENIZER) == 128_256
    # a node's word is bounded by the ids the gateway's prefix hashes and detokenizer take
    cluster.remove("padded")
    huge = msgspec.structs.replace(_info("huge"), vocab_size=1 << 63)
    assert cluster.register(huge, b"huge", 0.0, "t") is None
    assert cluster.vocab_size(TOKENIZER) == TOKEN_ID_LIMIT


@pytest.mark.parametrize(
    ("said", "token", "served"),
    [(40_000, 45_000, False), (128_256, 60_000, True)],
    ids=["past-the-model", "padded-past-the-tokenizer"],
)
async def test_a_resumed_prompt_is_held_to_the_models_vocabulary(tokenizer, said, token, served):
    """A node hands over a stream whose prompt has an id its model lacks (below the
    tokenizer's vocabulary): malformed, a 502 (it was served, and re-placed on nodes that
    refuse it); one a padded model has past the tokenizer's is served (it was a 502)."""
    assert tokenizer.vocab_size == TOKENIZER
    link, let_go = _Link(), list[tuple[str, str]]()
    resumes, table = _resumes(tokenizer, link, let_go)
    node = resumes.cluster.nodes["d0"]
    node.info = msgspec.structs.replace(node.info, vocab_size=said)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    resumes.answered(b"d0", Adopted(request_id=f"{ID}.0", found=True, prompt_ids=[5, token],
                                    output_ids=[7, 8], base=0, params=params))  # fmt: skip
    if served:
        req, _, _ = await task
        assert req.prompt_ids == [5, token] and table.get(f"{ID}.0") is not None
        return
    with pytest.raises(ApiError) as err:
        await task
    assert err.value.status == 502 and f"0 to {said - 1}" in err.value.message, err.value.message
    assert let_go == [(f"{ID}.0", "d0")] and len(table) == 0
