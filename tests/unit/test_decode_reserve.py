"""A decode node refuses KV for more tokens than its context holds (decode_node/server.py
`reserve_kv`): the sequence's first step would read past the model's position tables and
fail the whole batch, stopping the node. Any peer reaching the data socket can send one."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import KvHeader
from pdserve.decode_node.server import DecodeRole


def _role(max_model_len: int) -> DecodeRole:
    role = DecodeRole.__new__(DecodeRole)
    role.node = SimpleNamespace(  # type: ignore[assignment]
        draining=False,
        requests={},
        engine=SimpleNamespace(max_model_len=max_model_len),
    )
    return role


def _header(n: int) -> KvHeader:
    return KvHeader(request_id="r.0", prompt_ids=list(range(n)), num_prompt_tokens=n,
                    params=SamplingParams(), num_layers=30, frame_bytes=1024,
                    prefill_node="p-1")  # fmt: skip


def test_kv_for_a_sequence_as_long_as_the_context_is_refused():
    assert _role(64).reserve_kv(_header(64)) == "64 tokens: longer than this node's context"
    assert _role(64).reserve_kv(_header(200)) == "200 tokens: longer than this node's context"
