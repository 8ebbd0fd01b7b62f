"""A draining decode node's sequence whose migration target refused its KV, with no other
decode node to take it, is kept and decoded here (common/node/handoff.py). It must no longer
look on its way: an adopter asking for it (its gateway gone) was told "in prefill" for as
long as it decoded, and it was freed at the grace's end instead of resumed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.handoff import KvHandoff
from pdserve.common.node.role import NodeRequest
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import DecodeTarget


async def _no_step(rid: str) -> None:
    return None


def test_a_migration_kept_here_after_a_refusal_is_no_longer_on_its_way():
    seq = Sequence.new("m.0", [1, 2, 3], SamplingParams(max_tokens=8))
    seq.token_ids.append(9)
    req = NodeRequest(seq=seq)
    req.target = DecodeTarget(node_id="decode-1", data_address="tcp://x:1", host_id="h")
    released: list[str] = []
    node = SimpleNamespace(
        requests={"m.0": req},
        scheduler=SimpleNamespace(parked={"m.0": seq}),
        sender=SimpleNamespace(release=released.append, transfers={}),
        steps=SimpleNamespace(out_of_step=_no_step),
    )
    kept: list[str] = []
    handoff = KvHandoff(node, keep=lambda rid: kept.append(rid) or True)  # type: ignore[arg-type]
    asyncio.run(handoff.send_kv("m.0", None))  # the gateway's Redirect(None) after the refusal
    assert kept == ["m.0"] and released == ["m.0"]
    assert node.requests["m.0"] is req and req.target is None
