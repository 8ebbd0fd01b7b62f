"""Handing a request's KV to a decode node and letting go of it once acknowledged: what a
prefill node does after every prefill, and a draining decode node does to move a running
sequence (live migration). The sequence waits parked in the scheduler (its blocks held, not
stepped) until `KvAck`; a refusal asks the gateway for another decode node (`NeedDecode` ->
`Redirect`), and the KV is sent again from the cache; `Redirect` to nobody lets it go (the
gateway re-places the request by recompute), or, for a migration, keeps it where it is.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.common.kv_transfer.base import Transfer
from pdserve.common.node.runtime import NodeBase
from pdserve.common.protocol import PREFIX_GONE, DecodeTarget, KvTransferred, NeedDecode

log = logging.getLogger(__name__)


class KvHandoff(NodeBase):
    def kv_acked(self, t: Transfer) -> None:
        req = self.requests.pop(t.request_id, None)
        if req is None:
            return
        self.scheduler.release(t.request_id)
        self.work.set()  # blocks freed: a waiting batch may fit now
        self.metrics.kv_sent(t.backend, t.total_bytes, t.seconds, t.overlap)
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
        self.spawn(self.send_gateway(record))

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        log.info("%s refused KV of %s: %s", peer, rid, why)
        req = self.requests.get(rid)
        if why.startswith(PREFIX_GONE) and req is not None and req.target is not None:
            self.spawn(self.send_kv(rid, req.target))  # the same node, the whole KV
            return
        await self.send_gateway(NeedDecode(request_id=rid, refused_by=peer, reason=why))

    def keep(self, rid: str) -> bool:
        """Nobody can take the KV: keep the sequence here (a draining decode node decodes
        it itself) instead of letting it go for the gateway to re-place."""
        return False

    async def send_kv(self, rid: str, target: DecodeTarget | None) -> None:
        """Send the KV of a parked sequence, whole, to `target` (None: nobody can take it)."""
        await self.out_of_step(rid)  # a pass may still be sending to the old peer
        req = self.requests.get(rid)
        if req is None or rid not in self.scheduler.parked:
            return
        self.sender.release(rid)
        if target is None and self.keep(rid):
            return
        if target is None:  # the gateway re-places the request
            self.requests.pop(rid)
            self.scheduler.release(rid)
            self.work.set()
            return
        req.target, req.skip = target, 0
        seq = req.seq
        prompt = seq.token_ids[:-1]  # the newest token is sent with KvDone, not as KV
        t = self.sender.begin(
            rid, target, prompt, seq.num_prompt_tokens, seq.params, seq.block_table
        )
        # staging reads only this request's blocks: it need not wait behind the next forward
        # pass in the engine thread
        payloads = await asyncio.to_thread(self.sender.stage_all, t)
        if self.requests.get(rid) is not req:  # aborted meanwhile
            return
        self.sender.push_all(t, payloads)
        self.sender.done(t, seq.token_ids[-1])
