"""What the gateway does with each message from the nodes: one handler per message type, in
one table per socket (`CONTROL`, `TOKENS`), one dispatch.

Every handler checks that the message comes from the node that holds the attempt it names
(the request table says which): a late or stray message for an attempt that moved on, or from
another node, changes nothing. Anyone who reaches the control port can send anything: a
message that is not one identity frame plus one well-formed payload is dropped, said in the
log at most every 10 s (node_input.py), and no message, however handled, ends a loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pdserve.common.kv_backends import BACKENDS
from pdserve.common.logs import cut
from pdserve.common.wire.protocol import (
    FREED,
    Abort,
    Accept,
    Adopted,
    Deregister,
    FirstToken,
    Fits,
    Heartbeat,
    HeartbeatReply,
    KvEvents,
    KvTransferred,
    Migrate,
    NeedDecode,
    Preempted,
    PrefillFailed,
    Probe,
    Redirect,
    Register,
    RegisterAck,
    RegisterRefuse,
    Reject,
    TokenBatch,
    Wanted,
)
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.link import NodeLink
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.node_input import TOKEN_ID_LIMIT, NodeInput
from pdserve.gateway.placement import Placer
from pdserve.gateway.plan import redirect
from pdserve.gateway.policies import Need, NodeView, Policy
from pdserve.gateway.pools import PoolCare
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.service import RequestService
from pdserve.gateway.succession import Succession, Verdict
from pdserve.gateway.table import Attempt, Phase, RequestTable

log = logging.getLogger(__name__)
JOIN = Verdict.JOIN
Handler = Callable[[Any, bytes, Any], Coroutine[Any, Any, None]]


class NodeMessages:
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        index: PrefixIndex,
        policy: Policy,
        placer: Placer,
        metrics: GatewayMetrics,
        link: NodeLink,
        service: RequestService,
        pools: PoolCare,
        drop: Callable[..., Awaitable[None]],
        tokenizer_fingerprint: str,
    ) -> None:
        self.cluster, self.table, self.index, self.policy = cluster, table, index, policy
        self.placer, self.metrics, self.link = placer, metrics, link
        self.service, self.pools = service, pools
        self.drop = drop  # a node gone: its requests are re-placed (gateway/liveness.py)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.input = NodeInput(metrics)  # decoded, counted, the malformed said and dropped
        self.succession = Succession(cluster)  # a node restarted under its id

    # -- loops -----------------------------------------------------------------------------
    async def control_loop(self) -> None:
        while True:
            frames = await self.link.control.recv_multipart()
            msg = self.input.control(frames)
            if (handler := CONTROL.get(type(msg))) is None:
                continue
            try:
                await handler(self, frames[0], msg)
            except Exception:
                log.exception("handling %s failed", type(msg).__name__)

    async def tokens_loop(self) -> None:
        while True:
            msg = self.input.tokens(await self.link.tokens.recv())
            if (handler := TOKENS.get(type(msg))) is None:
                continue
            try:
                await handler(self, b"", msg)
            except Exception:
                log.exception("handling %s failed", type(msg).__name__)

    def _held_by(self, identity: bytes, rid: str, role: str) -> Attempt | None:
        """The attempt `rid` if the node speaking (by socket identity) holds it in `role`."""
        attempt = self.table.get(rid)
        node = self.cluster.by_identity(identity)
        if attempt is None or node is None or getattr(attempt, role) != node.node_id:
            return None
        return attempt

    # -- control socket --------------------------------------------------------------------
    async def _on_register(self, identity: bytes, msg: Register) -> None:
        info, now = msg.info, time.monotonic()
        # only a node that may join replaces its old self (anyone could name a live node)
        fits = self.cluster.refusal(info, self.tokenizer_fingerprint) is None
        if fits and self.pools.switched_away(info, identity):
            await self.drop(info.node_id, f"switched to {info.role}", "preempted")
        elif fits and (verdict := self.succession.verdict(info.node_id, identity, now)) != JOIN:
            if verdict is Verdict.WAIT:
                return  # not answered: it registers again at its next heartbeat
            await self.drop(info.node_id, "restarted (a new process under its id)")
        reason = self.cluster.register(info, identity, now, self.tokenizer_fingerprint)
        if reason is not None:
            reason = cut(reason, 512)  # it repeats the node's strings (its id, its model id)
            log.warning("refused node %s: %s", cut(info.node_id), reason)
            await self.link.reply(identity, RegisterRefuse(node_id=info.node_id, reason=reason))
            return
        log.info("registered %s node %s (%s)", info.role, info.node_id, info.model_id)
        self.pools.registered(info, identity, now, msg.served_s)
        self.index.drop(info.node_id)  # a new process: its snapshot follows
        ack = RegisterAck(
            node_id=info.node_id,
            tokens_address=self.link.tokens_address,
            # the policy decides how prefill nodes take offers: one rule, whatever launched them
            queueing=self.policy.queueing,
            gateway_id=self.link.gateway_id,
        )
        await self.link.reply(identity, ack)
        self.placer.capacity_changed()

    async def _on_probe(self, identity: bytes, msg: Probe) -> None:
        """A node asks before loading its weights; nothing is registered or kept."""
        reason = self.cluster.refusal(msg, self.tokenizer_fingerprint, time.monotonic())
        if reason is not None:
            reason = cut(reason, 512)
            log.warning("refused node %s before it loaded: %s", cut(msg.node_id), reason)
            await self.link.reply(identity, RegisterRefuse(node_id=msg.node_id, reason=reason))
            return
        await self.link.reply(identity, Fits(node_id=msg.node_id))

    async def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        now = time.monotonic()
        known = self.cluster.heartbeat(msg.node_id, identity, msg.load, now, msg.leader)
        # the lease: ids the node holds that the gateway no longer knows are freed there
        stale = (
            tuple(
                r
                for r in msg.load.held
                # an orphan this gateway is adopting: in its table once the resume reads the
                # answer, which may come after the node's next heartbeat names it as ours
                if self.table.get(r) is None and not self.service.resumes.claims(r)
            )
            if known
            else ()
        )
        if known:
            self.pools.others.relayed(msg.load.gateways, now)  # several gateways' loads
            if msg.events is not None and msg.events.node_id == msg.node_id:
                self._apply_events(msg.events)
            self.index.check(msg.node_id, msg.kv_seq)
        resync = (
            known and msg.node_id in self.index.nodes and self.index.needs_snapshot(msg.node_id)
        )
        if msg.reply or stale or not known or resync:
            load = self.pools.own_load() if known else None  # relayed to the other gateways
            reply = HeartbeatReply(stale=stale, unknown_node=not known, kv_resync=resync,
                                   load=load)  # fmt: skip
            await self.link.reply(identity, reply)
        self.placer.capacity_changed()

    async def _on_answer(self, identity: bytes, msg: Accept | Reject) -> None:
        accepted = isinstance(msg, Accept)
        if msg.foreign is not None and (node := self.cluster.by_identity(identity)) is not None:
            node.foreign = msg.foreign  # what it holds for other gateways, as of now
        room = msg.room if isinstance(msg, Reject) else -1
        if not self.placer.answer(msg.request_id, identity, accepted, room) and accepted:
            # too late: that offer timed out and the request moved on under a new wire id,
            # so this aborts exactly the stale acceptance
            await self.link.reply(identity, Abort(request_id=msg.request_id))

    async def _on_adopted(self, identity: bytes, msg: Adopted) -> None:
        self.service.resumes.answered(identity, msg)

    async def _on_wanted(self, identity: bytes, msg: Wanted) -> None:
        if (node := self.cluster.by_identity(identity)) is not None:
            self.service.wanted(msg.request_id, node.node_id, msg.taken)

    async def _on_first_token(self, identity: bytes, msg: FirstToken) -> None:
        attempt = self._held_by(identity, msg.request_id, "prefill")
        self.placer.capacity_changed()
        if attempt is None or not 0 <= msg.token_id < TOKEN_ID_LIMIT:
            return  # an old attempt's, or not from the node that holds the request
        req, prefill, now = attempt.req, attempt.prefill, time.monotonic()
        self.table.prefilled(attempt, now)  # `delivered` below forgets the prefill node
        req.mark(f"prefilled.{req.attempt}")
        req.timeline[f"prefill_ms.{req.attempt}"] = round(msg.prefill_ms, 3)
        req.timeline[f"queue_ms.{req.attempt}"] = round(msg.queue_ms, 3)
        if (node := self.cluster.nodes.get(attempt.prefill or "")) is not None:
            node.progress_at = now
        local = node is not None and node.node_id == attempt.decode and node.info.role == "decode"
        if local:  # a decode node prefilled it itself: counted whatever its finish, as there
            self.service.prefilled_locally(req, now)
        if msg.finish_reason is not None:
            self.table.delivered(attempt, now)  # it ended here: the node kept no KV for it
        elif local:
            self.table.prefilled_in_place(attempt, now)
        self.service.on_token(req, msg.index, msg.token_id, msg.finish_reason, prefill)
        self.service.settle(req)  # its client left: let go now its KV is where it decodes
        if attempt.move_asked is not None:  # its decode node waits, parked, to move it
            await self._move_asked(attempt, attempt.move_asked)

    async def _on_kv_transferred(self, identity: bytes, msg: KvTransferred) -> None:
        if (attempt := self._held_by(identity, msg.request_id, "prefill")) is not None:
            self.table.delivered(attempt, time.monotonic())  # first: metrics below may raise
            req = attempt.req
            self.service.settle(req)  # its client left: let go now its KV is where it decodes
            fields = ("backend", "bytes", "layerwise", "start_ms", "end_ms", "overlap_ms")
            req.timeline[f"kv_transfer.{req.attempt}"] = {  # type: ignore[assignment]
                f: round(v, 3) if isinstance(v := getattr(msg, f), float) else v for f in fields
            }
        node = self.cluster.by_identity(identity)
        # labels from registered nodes only (a series per string sent would grow /metrics
        # without bound); a negative count fails Counter.inc
        if node is not None and msg.backend in BACKENDS and msg.bytes >= 0:
            self.metrics.kv_bytes.labels(node.node_id, msg.backend).inc(msg.bytes)
            seconds = (msg.end_ms - msg.start_ms) / 1000
            self.metrics.kv_seconds.labels(msg.backend).observe(seconds)
            self.metrics.kv_overlap.labels(msg.backend).observe(msg.overlap_ms / 1000)

    async def _on_need_decode(self, identity: bytes, msg: NeedDecode) -> None:
        attempt = self._held_by(identity, msg.request_id, "prefill")
        refused = self.cluster.nodes.get(msg.refused_by)
        if refused is not None and attempt is not None and attempt.decode == msg.refused_by:
            refused.refused_at = time.monotonic()  # its report is stale until a newer one
        if attempt is None or attempt.req.finished:
            await self.link.reply(identity, Redirect(request_id=msg.request_id, decode=None))
            return
        # not the asker either: a draining decode node moving its sequence (live migration)
        if await self._move(identity, attempt, {msg.refused_by, attempt.prefill or ""}) is not None:
            return
        asker = self.cluster.by_identity(identity)
        stay = Redirect(request_id=msg.request_id, decode=None)
        if asker is None or asker.info.role != "decode":
            await self.link.reply(identity, stay)
            # spawned, not awaited: the re-placement waits for an Accept this loop reads
            why = f"{msg.refused_by} refused and no decode node had room"
            self.service.spawn(self.service.replace(attempt, why, "no_room"))
            return
        # a migration whose target refused and no other can take it: the draining node
        # still holds the KV and decodes it itself
        self.table.stay(attempt, time.monotonic())
        self.service.settle(attempt.req)  # its client left: let go, the KV is there
        self.metrics.migrations.labels("stayed").inc()
        await self.link.reply(identity, stay)

    async def _on_migrate(self, identity: bytes, msg: Migrate) -> None:
        """A draining or rebalanced decode node moves a running sequence: to the node the
        rebalance chose while it fits there, else another decode node for its KV (as for a
        refused transfer); none: the node keeps it."""
        attempt = self._held_by(identity, msg.request_id, "decode")
        if attempt is None or attempt.req.finished:
            await self.link.reply(identity, Redirect(request_id=msg.request_id, decode=None))
            return
        if attempt.phase is not Phase.DECODE:
            # its first token not read yet (a KV just admitted, its prefill node's FirstToken
            # still on that node's pipe): moved now, the table would name the mover its
            # prefill side and drop that token; answered "stay", it was never asked again.
            # Answered once that token is read (the sequence waits parked, its KV held)
            attempt.move_asked = attempt.decode
            return
        await self._migrate(identity, attempt)

    async def _move_asked(self, attempt: Attempt, asker: str) -> None:
        """The first token of an attempt whose decode node asked to move it is read: answer."""
        attempt.move_asked = None
        node = self.cluster.nodes.get(asker)
        if node is None:  # gone: nothing to move
            return
        if attempt.decode != asker:  # no longer its (placed elsewhere): its copy waits parked
            await self.link.reply(node.identity, Abort(request_id=attempt.wire_id))
            return
        if attempt.req.finished:  # ended at that token: stays until its abort comes
            await self.link.reply(node.identity, Redirect(request_id=attempt.wire_id, decode=None))
            return
        await self._migrate(node.identity, attempt)

    async def _migrate(self, identity: bytes, attempt: Attempt) -> None:
        old = attempt.decode
        target = await self._move(identity, attempt, {old or ""}, migrating=True)
        if target is None:  # the node decodes it on
            self.metrics.migrations.labels("stayed").inc()
            await self.link.reply(identity, Redirect(request_id=attempt.wire_id, decode=None))
            return
        self.metrics.migrations.labels("moved").inc()
        log.info("migrating %s: %s -> %s", attempt.wire_id, old, target.node_id)

    async def _move(self, identity: bytes, attempt: Attempt, exclude: set[str],
                    migrating: bool = False) -> NodeView | None:  # fmt: skip
        """Another decode node for the attempt's KV as it is now (a refused transfer's, or a
        running sequence's leaving its node: the target a rebalance chose, while it fits),
        booked in the table and named to the asker (`Redirect`); None: none has room."""
        tokens, now = attempt.kv_len, time.monotonic()
        need = Need(tokens, frozenset(exclude), attempt.hashes, max(0, attempt.final_len - tokens))
        planned = self.pools.planned.take(attempt.wire_id, now) if migrating else None
        target = redirect(self.policy, self.cluster, self.table, need, self.index, planned)
        if target is not None:
            book = self.table.migrate if migrating else self.table.redirect
            book(attempt, target.node_id, target.blocks_for(tokens + 1), now)
            to = Redirect(request_id=attempt.wire_id, decode=target.node.target())
            await self.link.reply(identity, to)
        return target

    async def _on_prefill_failed(self, identity: bytes, msg: PrefillFailed) -> None:
        attempt = self._held_by(identity, msg.request_id, "prefill")
        if attempt is not None:
            # spawned, not awaited (the re-placement waits for an Accept this loop reads); freed
            # while this gateway was silent: no node failed, not counted as a loss
            kind = "preempted" if msg.reason == FREED else "lost"
            self.service.spawn(self.service.replace(attempt, f"prefill failed: {msg.reason}", kind))

    async def _on_kv_events(self, identity: bytes, msg: KvEvents) -> None:
        node = self.cluster.nodes.get(msg.node_id)
        if node is None or node.identity != identity:
            return  # not from the registered node of that name
        self._apply_events(msg)

    def _apply_events(self, msg: KvEvents) -> None:
        if not self.index.apply(msg):
            log.info("KV events of %s lost: asking for a snapshot", msg.node_id)

    async def _on_deregister(self, identity: bytes, msg: Deregister) -> None:
        if (node := self.cluster.nodes.get(msg.node_id)) is not None and node.identity == identity:
            await self.drop(msg.node_id, "node left", "preempted" if node.load.draining else "lost")

    # -- tokens socket ---------------------------------------------------------------------
    async def _on_token_batch(self, _: bytes, msg: TokenBatch) -> None:
        if (entries := self.input.entries(msg)) is None:  # the bad ones said, at most every 10 s
            return
        node = self.cluster.nodes.get(msg.node_id)
        if node is not None:
            node.progress_at = time.monotonic()
        for rid, token, index, reason in entries:
            attempt = self.table.get(rid)
            # only from the node the KV went to (None: not placed yet as far as this side
            # knows; the wire id alone is this attempt's), or the decode node it moved off
            # (its last step's tokens may come after the new node was chosen, or even after
            # its KvTransferred, read off the other socket): duplicates are dropped by index
            if attempt is not None and (
                attempt.decode is None
                or msg.node_id in (attempt.decode, attempt.prefill, attempt.moved_from)
            ):
                self.service.on_token(attempt.req, index, token, reason, msg.node_id)
            elif attempt is None:  # a stream being resumed: its node's tokens may come first
                self.service.resumes.early(rid, msg.node_id, index, token, reason)

    async def _on_preempted(self, _: bytes, msg: Preempted) -> None:
        attempt = self.table.get(msg.request_id)
        if attempt is not None and attempt.decode == msg.node_id:
            self.service.spawn(self.service.replace(attempt, msg.reason, "preempted"))
        elif attempt is None:  # a stream being resumed here, given back before it was rebuilt
            self.service.resumes.preempted(msg.request_id, msg.node_id, msg.reason)


CONTROL: dict[type, Handler] = {
    Register: NodeMessages._on_register,
    Probe: NodeMessages._on_probe,
    Heartbeat: NodeMessages._on_heartbeat,
    Adopted: NodeMessages._on_adopted,
    Wanted: NodeMessages._on_wanted,
    Accept: NodeMessages._on_answer,
    Reject: NodeMessages._on_answer,
    FirstToken: NodeMessages._on_first_token,
    KvTransferred: NodeMessages._on_kv_transferred,
    KvEvents: NodeMessages._on_kv_events,
    NeedDecode: NodeMessages._on_need_decode,
    Migrate: NodeMessages._on_migrate,
    PrefillFailed: NodeMessages._on_prefill_failed,
    Deregister: NodeMessages._on_deregister,
}
TOKENS: dict[type, Handler] = {
    TokenBatch: NodeMessages._on_token_batch,
    Preempted: NodeMessages._on_preempted,
}
