"""A node's control plane, the same for every role: registration, heartbeats, leases, drain.

A node connects a DEALER (identity = node id + a random suffix) to each gateway's control
ROUTER (common/node/links.py: one link per gateway, and which gateway each request belongs
to), registers, and sends a heartbeat with its load every `heartbeat_interval`. The reply
names request ids that gateway no longer knows (the node frees them: leases) or says the
gateway does not know the node (it restarted): the node registers again. A gateway silent
for `heartbeat_timeout` leaves orphans (common/node/adoption.py). SIGTERM drains: stop taking
work, finish what is held (or hand it back after `drain_timeout`), exit. A loop that dies
takes the node down: a supervisor restarts it. A refusal stops a node, but not in a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

from pdserve.common.config import NodeConfig
from pdserve.common.errors import PdserveError
from pdserve.common.node.adoption import Adoption, tell_returned
from pdserve.common.node.events import PrefixEvents
from pdserve.common.node.fairness import STALE, Fairness
from pdserve.common.node.gateways import Gateways
from pdserve.common.node.links import GatewayLink, beat_delay, dynamic, gateway_addresses, resolve
from pdserve.common.node.role import NodeState, RoleMessages
from pdserve.common.node_metrics import NodeMetrics, start_http
from pdserve.common.wire.protocol import (
    GATEWAY_DECODER,
    Abort,
    Adopt,
    Drain,
    HeartbeatReply,
    KvEvents,
    Load,
    Msg,
    PrefillOffer,
    Rebalance,
    Redirect,
    RegisterAck,
    RegisterRefuse,
    Reject,
    Release,
    SwitchRole,
)
from pdserve.common.wire.transport import decode_or_none

log = logging.getLogger(__name__)
DISCOVERY_S = 5.0  # how often gateway host names are resolved again


class RegistrationRefused(PdserveError):
    pass


class ControlPlane:
    def __init__(
        self,
        cfg: NodeConfig,
        node_id: str,
        ctx: Any,
        node: NodeState,
        role: RoleMessages,
        events: PrefixEvents,
        metrics: NodeMetrics,
    ) -> None:
        self.cfg, self.node_id, self.ctx = cfg, node_id, ctx
        self.node, self.role, self.events, self.metrics = node, role, events, metrics
        self.identity = f"{node_id}/{secrets.token_hex(4)}"  # unique even for a duplicate id
        links = [GatewayLink(ctx, a, self.identity) for a in gateway_addresses(cfg.gateway)]
        self.gateways = Gateways(node_id, links, node)
        self.owners = self.gateways.owners
        self.adoption = Adoption(self.gateways, node, cfg.orphan_grace, cfg.heartbeat_timeout,
                                 metrics.orphans)  # fmt: skip
        self.fairness = Fairness()  # freed room to the oldest request of any gateway
        self.registered = asyncio.Event()  # with at least one gateway
        self.stopped = asyncio.Event()
        self.draining = False
        self.switch_to: str | None = None  # the role to take once drained (SwitchRole)
        self.tasks: list[asyncio.Task] = []
        self.http: Any = None

    # -- the gateways (common/node/gateways.py) ---------------------------------------------
    @property
    def links(self) -> list[GatewayLink]:
        return self.gateways.links

    async def send(self, msg: Msg) -> None:
        await self.gateways.send(msg)

    async def push_tokens(self, msg: Msg) -> None:
        """Token batches and preemptions, once registered with a gateway; at once while
        draining (no gateway left: a drain's hand-back waited for good, never exiting)."""
        if not self.draining:
            await self.registered.wait()
        await self.gateways.push(msg)

    def health(self) -> str | None:
        """None while serving (registered, engine not hung, not draining), else why not."""
        if self.draining:
            return "draining"
        if not self.registered.is_set():
            return f"not registered with the gateway at {self.cfg.gateway}"
        return self.node.hung()

    # -- life ----------------------------------------------------------------------------------
    async def start(self, role_tasks: list[asyncio.Task]) -> None:
        """The control loops and /metrics; then register. The role's own loops are watched
        with them: any one that dies stops the node. (Signals: common/node/roles.py.)"""
        for link in self.links:
            link.task = asyncio.create_task(self._control_loop(link))
        self.tasks += [
            *role_tasks,
            *(link.task for link in self.links),
            asyncio.create_task(self._heartbeat_loop()),
        ]
        if dynamic(self.cfg.gateway):
            self.tasks.append(asyncio.create_task(self._discovery_loop()))
        for task in self.tasks:
            task.add_done_callback(self._task_ended)
        if self.cfg.metrics_port:
            self.http = await start_http(self.metrics, self.health, self.node.hung,
                                         self.cfg.metrics_host, self.cfg.metrics_port)  # fmt: skip
        if self.draining:  # signalled as it started (a switch's new role, a first start):
            return  # it holds nothing, and registers with no gateway on its way out
        for link in self.links:
            await self.gateways.register(link)

    async def wait_stopped(self) -> None:
        await self.stopped.wait()
        for task in self.tasks:  # a dropped link's loop is cancelled, not failed
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _task_ended(self, task: asyncio.Task) -> None:
        """A loop that dies takes the node down (heartbeating with a dead engine loop, it would
        be offered work forever): its requests re-placed, a supervisor restarts it."""
        if task.cancelled() or task.exception() is None:
            return
        if not isinstance(task.exception(), RegistrationRefused):  # that one is logged already
            log.error("%s: a node loop failed; stopping", self.node_id, exc_info=task.exception())
        self.stopped.set()

    async def stop(self) -> None:
        """Deregister and end the loops (the role's included)."""
        with contextlib.suppress(asyncio.TimeoutError):  # 3.10: not builtin
            await asyncio.wait_for(self.gateways.deregister(), 1.0)  # each send bounded alone
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.http is not None:
            await self.http.cleanup()

    def close(self) -> None:
        for link in self.links:
            link.close()

    def on_signal(self) -> None:
        """SIGTERM or SIGINT: drain and exit (a second: stop now); a switch's drain goes on."""
        switching, self.switch_to = self.switch_to is not None and self.draining, None
        if not switching:
            self.begin_drain()

    def begin_drain(self) -> None:
        if self.draining:
            self.stopped.set()  # a second signal: stop now
            return
        log.info("%s draining", self.node_id)
        self.draining = True
        self.tasks.append(asyncio.create_task(self._drain()))
        self.role.on_drain()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout
        while not self.node.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.node.idle():
            await self.role.on_drain_timeout()
        self.stopped.set()

    # -- from the gateways ---------------------------------------------------------------------
    async def _control_loop(self, link: GatewayLink) -> None:
        while True:
            msg = decode_or_none(GATEWAY_DECODER, await link.control.recv())
            link.last_reply = time.monotonic()
            try:
                await self._dispatch(link, msg)
            except RegistrationRefused:
                raise
            except Exception:  # one message it cannot act on (a bad address, say): dropped
                log.exception("%s: %s from %s failed", self.node_id, type(msg).__name__,
                              link.address)  # fmt: skip

    async def _dispatch(self, link: GatewayLink, msg: Any) -> None:
        match msg:
            case RegisterAck():
                self._registered(link, msg)
                await tell_returned(self.adoption, link, self.role.pushes_tokens)
            case RegisterRefuse(reason=reason) if self.draining:  # its streams end first
                log.error("gateway %s refused draining %s: %s", link.address, self.node_id, reason)
                link.refused = True  # not asked again in this drain (it would refuse each beat)
            case RegisterRefuse(reason=reason):
                log.error("gateway %s refused %s: %s", link.address, self.node_id, reason)
                link.refused = True  # not deregistered from: the id may be another's there
                self.stopped.set()
                raise RegistrationRefused(reason)
            case HeartbeatReply(stale=stale, unknown_node=unknown):
                mine = tuple(r for r in stale if self.gateways.leased_by(r, link))
                self.node.free_stale(mine)
                link.load = msg.load or link.load  # relayed to the other gateways
                if msg.kv_resync:
                    self.events.resync()
                # paused, not gone: it answered a beat sent since, not a dead one's late last word
                if not unknown and link.silent_for() >= self.cfg.heartbeat_interval:
                    await self._back(link)
                # dropped (hung: back once it steps) or restarted: draining too, its streams orphans
                if unknown and not self.node.hung() and not link.refused:
                    link.registered = False
                    await self.gateways.register(link)
            case SwitchRole() if not self.gateways.obeys(link):
                log.warning("%s: switch from %s, not the leader", self.node_id, link.address)
            case SwitchRole(role=role) if role != self.role.role and not self.draining:
                # the other role in this process: drain as for SIGTERM, then the serving
                # loop (common/node/roles.py) starts the other role's node on the engine
                log.info("%s switching to %s", self.node_id, role)
                self.switch_to = role
                self.begin_drain()
            case SwitchRole():
                log.info("%s: role switch ignored (draining, or that role)", self.node_id)
            case Adopt() | Release():
                await self.adoption.on_gateway(msg, link)
            case None:
                log.warning("dropping malformed message from the gateway at %s", link.address)
            case _:
                await self._for_role(link, msg)

    async def _for_role(self, link: GatewayLink, msg: Any) -> None:
        """A gateway acts only on its own requests: another gateway's id is not its to take,
        abort, redirect or move (several gateways, one cluster)."""
        match msg:
            case PrefillOffer(request_id=rid) if not self.owners.adopt(rid, link):
                reject = Reject(request_id=rid, reason="duplicate request id", room=-1)
                await link.send(reject)
                return
            case PrefillOffer() if len(self.links) > 1:
                await self._offer(link, msg)
                return
            case Abort(request_id=rid) | Redirect(request_id=rid) if not self._its(link, rid):
                log.warning("%s for %s from a gateway it does not belong to: dropped",
                            type(msg).__name__, rid)  # fmt: skip
                return
            case Drain() if self.draining or not self.gateways.obeys(link):
                # a second Drain (two gateways, a repeat) was a second SIGTERM: stop at once
                log.warning("Drain from %s ignored (draining, or not the leader)", link.address)
                return
            case Rebalance() if not self.gateways.obeys(link):
                log.warning("rebalance from %s, not the leader: ignored", link.address)
                return
            case Rebalance(request_ids=rids):
                msg = Rebalance(request_ids=tuple(r for r in rids if self._its(link, r)))
        await self.role.on_gateway_message(msg)  # a failure: logged by the control loop

    def _its(self, link: GatewayLink, rid: str) -> bool:
        return self.gateways.link_for(rid) is link

    async def _offer(self, link: GatewayLink, offer: PrefillOffer) -> None:
        """An offer when several gateways share this node: refused when placed on a stale
        view, and freed room goes to the request that has waited longest, whichever gateway
        holds it (common/node/fairness.py)."""
        rid, n, now = offer.request_id, len(offer.prompt_ids), time.monotonic()
        since = now - offer.waited_ms / 1000
        room = None if self.draining else self.role.room()
        others = sum(self.gateways.foreign(link).prefill)
        why = None
        if room is not None:
            why = self.fairness.refusal(link, since, n, room, now, offer.foreign_prefill, others)
        if why is not None:
            self.metrics.offer(False)
            await self.send(Reject(request_id=rid, reason=why[0], room=why[1]))
            if why[0] != STALE:
                self.fairness.answered(link, rid, since, n, False, now)
            return
        try:
            await self.role.on_gateway_message(offer)
        except Exception:
            log.exception("handling PrefillOffer failed")
        if room is not None:
            self.fairness.answered(link, rid, since, n, self.node.holds(rid), now)

    def _registered(self, link: GatewayLink, ack: RegisterAck) -> None:
        link.connect_tokens(ack.tokens_address, self.role.pushes_tokens)  # may raise: first
        # a new process: the old one's requests are orphans (another gateway may adopt
        # them, common/node/adoption.py), never this one's to free as stale
        if self.adoption.registered(link, ack.gateway_id, time.monotonic()):
            self.fairness.forget(link)
        link.silent_since = None
        self.events.resync()  # a new gateway, or one that dropped us
        self.role.on_registered(ack)
        link.registered_as(ack.gateway_id)
        if self.gateways.first_ack is None:  # the role-switch dwell runs from it
            self.gateways.first_ack = time.monotonic()
        self.registered.set()
        log.info("%s registered with the gateway at %s", self.node_id, link.address)

    async def _back(self, link: GatewayLink) -> None:
        """A gateway taken for silent answers again as the same process, knowing us: back
        with it, told what was taken meanwhile, as at a RegisterAck (the knock's may not come)."""
        self.adoption.registered(link, link.gateway_id, time.monotonic())
        link.silent_since = None
        self.events.resync()  # its events went nowhere meanwhile
        link.registered_as(link.gateway_id)
        self.registered.set()
        await tell_returned(self.adoption, link, self.role.pushes_tokens)

    async def _discovery_loop(self) -> None:
        """Gateways named by a host name come and go (pods of a headless Service): resolve
        the names again, link to new gateways, and let a vanished one go once its requests
        are past the orphan grace."""
        while True:
            await asyncio.sleep(DISCOVERY_S)
            resolved = await asyncio.to_thread(resolve, self.cfg.gateway)
            wanted = {ip for ips in resolved.values() for ip in ips}
            wanted |= {name for name, ips in resolved.items() if not ips}
            for name, ips in resolved.items():
                for address in ips:
                    if all(k.address != address for k in self.links):
                        await self._add_link(address)
                if ips:  # a name link kept while it resolved to nothing: its IPs replace it
                    for link in [k for k in self.links if k.address == name]:
                        self._drop_link(link)
            late = self.cfg.heartbeat_timeout + self.cfg.orphan_grace
            now = time.monotonic()
            for link in list(self.links):
                gone = link.silent_since is not None and now - link.silent_since > late
                if link.address not in wanted and gone and len(self.links) > 1:
                    self._drop_link(link)

    async def _add_link(self, address: str) -> None:
        log.info("%s: a gateway at %s", self.node_id, address)
        link = GatewayLink(self.ctx, address, self.identity)
        self.links.append(link)
        link.task = asyncio.create_task(self._control_loop(link))
        link.task.add_done_callback(self._task_ended)
        self.tasks.append(link.task)
        await self.gateways.register(link)

    def _drop_link(self, link: GatewayLink) -> None:
        log.info("%s: the gateway at %s is no more", self.node_id, link.address)
        if link.gateway_id:
            self.adoption.retire(link, time.monotonic())  # its requests: orphans, adoptable
        self.links.remove(link)
        self.tasks.remove(link.task)
        link.task.cancel()
        link.close()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(beat_delay(time.time(), self.cfg.heartbeat_interval))
            load = self.node.load()
            self.adoption.sweep(load.held)
            events = self.events.take() if self.registered.is_set() else []
            for link in self.links:
                await self._heartbeat(link, load, events[0] if events else None)
            for more in events[1:]:  # a large snapshot's other parts
                await self.gateways.send(more)
            self.adoption.expire(time.monotonic())
            if not any(link.registered for link in self.links):
                self.registered.clear()

    async def _heartbeat(self, link: GatewayLink, load: Load, events: KvEvents | None) -> None:
        due = link.reply_due(self.cfg.heartbeat_timeout, self.cfg.heartbeat_interval)
        beat = self.gateways.heartbeat(link, load, events, self.events.seq(), due)
        silent = time.monotonic() - link.last_reply
        if silent > self.cfg.heartbeat_timeout and not link.replies_waiting():
            # gone, restarted or paused: its requests orphans (--orphan-grace); knocked on
            if link.registered:
                log.warning("the gateway at %s is silent (%.1f s): its %d requests are "
                            "orphans for %.1f s", link.address, silent,
                            len(self.owners.owned(link)), self.cfg.orphan_grace)  # fmt: skip
                link.silent_since = time.monotonic()
                self.metrics.gateway_silences.inc()
                self.adoption.silenced(link)
                self.fairness.forget(link)
            link.registered = False
            await self.gateways.register(link)  # before the beat: a gateway
            link.last_reply = time.monotonic()  # that takes it then reads that we drain
        await link.send(beat)
