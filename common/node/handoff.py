"""Handing a request's KV to a decode node and letting go of it once acknowledged: what a
prefill node does after every prefill, and a draining decode node does to move a running
sequence (live migration). The sequence waits parked in the scheduler (its blocks held, not
stepped) until `KvAck`; a refusal asks the gateway for another decode node (`NeedDecode` ->
`Redirect`), and the KV is sent again from the cache; `Redirect` to nobody lets it go (the
gateway re-places the request by recompute), or, for a migration, keeps it where it is. A
`Redirect` while the transfer is unanswered aborts it at its target (that node frees its
reservation), unless it names that target again: a repeat, and the transfer goes on. An
orphan's refusal asks nobody (its gateway is gone): a migration stays where it is, as if
told "stay"; a prefill node's is given back, its tokens kept for an adopter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.kv.base import Transfer
from pdserve.common.kv.sender import KvSender, TransferEnded
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.wire.kv_messages import (
    PREFIX_GONE,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
    KvTransferred,
    Msg,
    NeedDecode,
)

log = logging.getLogger(__name__)


class _Steps(Protocol):
    def wake(self) -> None: ...
    async def out_of_step(self, rid: str) -> None: ...


class HandoffHost(Protocol):
    """What a handoff needs of its node."""

    requests: dict[str, Any]  # wire id -> NodeRequest (.seq, .target, .skip, .accepted_at)
    scheduler: Scheduler
    metrics: NodeMetrics

    @property
    def steps(self) -> _Steps: ...
    @property
    def sender(self) -> KvSender: ...
    def spawn(self, coro: Any) -> None: ...
    async def send_gateway(self, msg: Msg) -> None: ...
    def gateway_of(self, rid: str) -> str: ...
    def let_orphan_go(self, rid: str) -> bool: ...
    def orphan(self, rid: str) -> bool: ...


class KvHandoff:
    def __init__(self, node: HandoffHost, keep: Callable[[str], bool] | None = None) -> None:
        """`keep(rid)`: nobody can take the KV; True keeps the sequence here (a draining
        decode node decodes it itself) instead of letting it go to be re-placed. None: the
        node keeps none (a prefill node)."""
        self.node, self.keep = node, keep

    def acked(self, t: Transfer) -> None:
        node = self.node
        req = node.requests.pop(t.request_id, None)
        if req is None:
            return
        node.scheduler.release(t.request_id)
        node.steps.wake()  # blocks freed: a waiting batch may fit now
        node.metrics.kv_sent(t.backend, t.total_bytes, t.seconds, t.overlap)
        base = req.accepted_at
        record = KvTransferred(
            request_id=t.request_id,
            backend=t.backend,
            bytes=t.total_bytes,
            layerwise=t.layerwise,
            start_ms=((t.first_byte or t.started) - base) * 1000,
            end_ms=(t.finished - base) * 1000,
            overlap_ms=t.overlap * 1000,
        )
        node.spawn(node.send_gateway(record))

    async def refused(self, rid: str, peer: str, why: str) -> None:
        log.info("%s refused KV of %s: %s", peer, rid, why)
        req = self.node.requests.get(rid)
        if why.startswith(PREFIX_GONE) and req is not None and req.target is not None:
            self.node.spawn(self.send_kv(rid, req.target))  # the same node, the whole KV
            return
        # no gateway reads a NeedDecode: a migration decodes on here, for an adopter (until
        # the grace or the drain ends, as an orphan a drain never moved); a prefill node's
        # tokens are kept for its adopter, which places it again
        if self.keep is not None and self.node.orphan(rid):
            self.node.spawn(self.send_kv(rid, None))
            return
        if self.node.let_orphan_go(rid):
            return
        await self.node.send_gateway(NeedDecode(request_id=rid, refused_by=peer, reason=why))

    async def send_kv(self, rid: str, target: DecodeTarget | None) -> None:
        """Send the KV of a parked sequence, whole, to `target` (None: nobody can take it)."""
        node = self.node
        await node.steps.out_of_step(rid)  # a pass may still be sending to the old peer
        req = node.requests.get(rid)
        if req is None or rid not in node.scheduler.parked:
            return
        live = node.sender.transfers.get(rid)
        if live is not None and not live.answered:  # its target has not answered it yet
            if target is not None and target.node_id == live.target.node_id:
                return  # a repeat of the Redirect that began it: that transfer goes on
            node.sender.abort(rid)  # sent elsewhere: that target drops its reservation
        node.sender.release(rid)
        if target is None and self.keep is not None and self.keep(rid):
            req.target = None  # decoded here: no longer on its way (an adopter may take it)
            return
        if target is None:  # the gateway re-places the request
            node.requests.pop(rid)
            node.scheduler.release(rid)
            node.steps.wake()
            return
        req.target, req.skip = target, 0
        seq = req.seq
        prompt = seq.token_ids[:-1]  # the newest token is sent with KvDone, not as KV
        t = node.sender.begin(rid, target, prompt, seq.num_prompt_tokens, seq.params,
                              seq.block_table, gateway=node.gateway_of(rid),
                              prompt_len=req.prompt_len,
                              stream_format=req.stream_format)  # fmt: skip
        # staging reads only this request's blocks: it need not wait behind the next forward
        # pass in the engine thread
        try:
            payloads = await asyncio.to_thread(node.sender.stage_all, t)
        except TransferEnded:  # aborted meanwhile
            return
        # aborted, or released for another send (a refusal, then a Redirect) as the last
        # layer staged: its segment may be the other's now
        if node.requests.get(rid) is not req or node.sender.transfers.get(rid) is not t:
            return
        node.sender.push_all(t, payloads)
        node.sender.done(t, seq.token_ids[-1])
