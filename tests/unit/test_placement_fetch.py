"""A prefix fetch hint in tokens (gateway/plan.py, gateway/placement.py): the index counts
the holder's blocks in the cluster's block size, whatever the fetching node's."""

from __future__ import annotations

import asyncio

from pdserve.common.wire.protocol import KvEvents, Load, PrefillOffer
from pdserve.gateway.cluster import ClusterView, NodeState
from pdserve.gateway.placement import Placer
from pdserve.gateway.plan import fetch_holders, request_hashes, views
from pdserve.gateway.policies import Need, make_policy
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.table import RequestTable
from tests.conftest import gateway_request
from tests.unit.test_policies import make_info


def _cluster() -> ClusterView:
    """d0 (blocks of 16, the first: the cluster's reference) can send KV; p0 has blocks of 32."""
    cluster = ClusterView(2.0)
    free = Load(running=0, waiting=0, blocks_free=100, blocks_cached=0, blocks_in_use=0)
    for info in (
        make_info("d0", role="decode", data_address="tcp://d0:1"),
        make_info("p0", block_size=32),
    ):
        cluster.register(info, info.node_id.encode(), 0.0, "t")
        cluster.heartbeat(info.node_id, info.node_id.encode(), free, 0.0)
    return cluster


def test_a_fetch_hint_counts_the_holders_blocks_in_their_own_size():
    """d0 holds 10 blocks of 16 tokens: 160 tokens. p0 was told 320 (10 x its own 32), asked
    d0 for more than it holds, and was refused."""
    cluster, table, index = _cluster(), RequestTable(), PrefixIndex()
    prompt = list(range(200))
    hashes = request_hashes(cluster, prompt)
    index.apply(KvEvents(node_id="d0", seq=0, stored=list(hashes[:10]), snapshot=True))
    need = Need(len(prompt), hashes=hashes)
    p0 = views(cluster, table, "prefill", index, need, fetch_holders(cluster, index, need))[0]
    assert (p0.holder_blocks, p0.fetchable_tokens) == (10, 160)

    sent: list[PrefillOffer] = []

    async def send_offer(node: NodeState, offer: PrefillOffer) -> None:
        sent.append(offer)
        placer.answer(offer.request_id, node.identity, True)

    placer = Placer(cluster, table, make_policy("on_demand"), send_offer, index, 1.0, 1.0)
    req = gateway_request("r", len(prompt))
    table.open(req, len(prompt))

    async def place() -> None:
        await placer.place(req, prompt, req.params)
        await placer.stop()

    asyncio.run(place())
    assert [(o.fetch_from.node_id if o.fetch_from else None, o.fetch_tokens) for o in sent] == [
        ("d0", 160)
    ]
