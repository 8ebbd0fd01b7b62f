"""Which gateway each request belongs to, and the way every message finds it (several
gateways, one cluster: docs/architecture.md, "Several gateways"). With one gateway every
request is its and nothing is looked up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import msgspec
import zmq

from pdserve.common.node.links import GatewayLink, Gone, Owner, Owners
from pdserve.common.wire.protocol import (
    Accept,
    Deregister,
    Foreign,
    Heartbeat,
    KvEvents,
    Load,
    Msg,
    NodeInfo,
    Preempted,
    Register,
    Reject,
    TokenBatch,
)

log = logging.getLogger(__name__)
DEREGISTER_S = 0.5  # a leaving role waits no longer on a gateway (its lease ends it)


class Holdings(Protocol):
    def info(self) -> NodeInfo: ...
    def load(self) -> Load: ...
    def foreign(self, request_ids: list[str]) -> Foreign: ...


class Gateways:
    def __init__(self, node_id: str, links: list[GatewayLink], node: Holdings) -> None:
        self.node_id, self.links, self.node = node_id, links, node
        self.owners = Owners()
        self.gone: list[Gone] = []  # gateway processes that came back under a new id
        self.first_ack: float | None = None  # this role's first RegisterAck (monotonic)

    async def register(self, link: GatewayLink) -> None:
        """Asks `link`'s gateway to register this node, saying how long it has served this
        role since its first registration with any gateway: a repeat (it was dropped, or the
        gateway restarted) keeps its role-switch dwell (gateway/roles.py). A duration, so no
        clocks need agree."""
        served = 0.0 if self.first_ack is None else time.monotonic() - self.first_ack
        link.asked = True
        await link.send(Register(info=self.node.info(), served_s=served))

    async def deregister(self) -> None:
        """Leaving: a Deregister to each gateway this role asked to register it (on that
        socket it follows the Register, answered or not) and that did not refuse it; none to
        a gateway that never heard of it (signalled as it started, say)."""
        asked = [link for link in self.links if link.asked and not link.refused]
        # side by side, each bounded: one gateway's full socket holds up no other's
        await asyncio.gather(*(self._deregister(link) for link in asked))

    async def _deregister(self, link: GatewayLink) -> None:
        with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):  # 3.10: not builtin
            await asyncio.wait_for(link.send(Deregister(node_id=self.node_id)), DEREGISTER_S)

    def link_for(self, rid: str) -> GatewayLink | None:
        """The live gateway `rid` belongs to (with one gateway, that one), None for an orphan
        of a gone gateway."""
        owner = self.owners.get(rid)
        if isinstance(owner, GatewayLink):
            return owner
        return self.links[0] if owner is None and len(self.links) == 1 else None

    def adopt(self, rid: str, gateway_id: str) -> bool:
        """A request's KV announced for the gateway `gateway_id` (decode): False when this
        node never heard of that gateway, or the id belongs to another gateway. A silent or
        gone gateway's request is taken as its orphan (another gateway may adopt it)."""
        owner: Owner | None = next((k for k in self.links if k.gateway_id == gateway_id), None)
        # its latest Gone: an older one of that id may be a stream let go long ago
        owner = owner or next((g for g in reversed(self.gone) if g.gateway_id == gateway_id),
                              None)  # fmt: skip
        if owner is None and not gateway_id and len(self.links) == 1:
            owner = self.links[0]
        return owner is not None and self.owners.adopt(rid, owner)

    def leased_by(self, rid: str, link: GatewayLink) -> bool:
        """Whether `link`'s lease may free `rid`: its own, or nobody's; never an orphan, which
        waits for an adopter until the grace ends (adoption.py)."""
        owner = self.owners.get(rid)
        return not isinstance(owner, Gone) and self.link_for(rid) in (link, None)

    def retire(self, link: GatewayLink, now: float) -> None:
        """`link`'s gateway came back as a new process: its old requests are orphans."""
        gone = Gone(link.gateway_id, link.silent_since or now)
        self.gone.append(gone)
        for rid in self.owners.owned(link):
            self.owners.move(rid, gone)

    def leader(self) -> str:
        """The gateway this node takes pool care from (role switches, rebalancing): the lowest
        id among the gateways it is registered with, so every gateway that hears from the
        same nodes agrees on one (docs/architecture.md, "Several gateways")."""
        return min((k.gateway_id for k in self.links if k.registered), default="")

    def obeys(self, link: GatewayLink) -> bool:
        return len(self.links) == 1 or link.gateway_id == self.leader()

    def gateway_of(self, rid: str) -> str:
        """The gateway id to name in a KvHeader for `rid` (a gone one's too: the decode node
        takes the KV as that gateway's orphan, for another gateway to adopt)."""
        owner = self.owners.get(rid)
        if isinstance(owner, Gone):
            return owner.gateway_id
        link = self.link_for(rid)
        return link.gateway_id if link is not None else ""

    def foreign(self, link: GatewayLink, held: tuple[str, ...] | None = None) -> Foreign:
        """What the node holds for the other gateways (one gateway: nothing); `held`: the
        ids of a load report just taken (else one is taken)."""
        if len(self.links) == 1:
            return Foreign()
        if held is None:
            held = self.node.load().held
        return self.node.foreign([r for r in held if self.owners.get(r) not in (link, None)])

    def heartbeat(self, link: GatewayLink, load: Load, events: KvEvents | None, last_seq: int,
                  reply: bool) -> Heartbeat:  # fmt: skip
        """The heartbeat to `link`'s gateway: its own held ids and what the node holds for
        the others; the prefix cache's events to a registered gateway only (one registering
        gets a snapshot after its ack), `kv_seq` the last KvEvents sent with or before it."""
        if len(self.links) > 1:
            held = tuple(r for r in load.held if self.owners.get(r) is link)
            load = msgspec.structs.replace(load, held=held, foreign=self.foreign(link, load.held))
        elif self.gone:  # orphans are no gateway's: not named to this one's lease
            held = tuple(r for r in load.held if not isinstance(self.owners.get(r), Gone))
            load = msgspec.structs.replace(load, held=held)
        events = events if link.registered else None
        # what the other gateways said of their load: the one leading pool care sizes for all
        said = tuple(k.load for k in self.links if k is not link and k.load is not None
                     and k.registered and k.silent_since is None)  # fmt: skip
        if said:
            load = msgspec.structs.replace(load, gateways=said)
        return Heartbeat(node_id=self.node_id, load=load, leader=self.leader(), events=events,
                         kv_seq=events.seq if events is not None else last_seq,
                         reply=reply)  # fmt: skip

    async def send(self, msg: Msg) -> None:
        """A request's message to its gateway; KvEvents to every registered gateway."""
        rid = getattr(msg, "request_id", None)
        if rid is None:
            for each in self.links:
                if each.registered or not isinstance(msg, KvEvents):
                    with contextlib.suppress(zmq.ZMQError):
                        await each.send(msg)
            return
        link = self.link_for(rid)
        if link is None:
            log.debug("no gateway for %s: %s dropped", rid, type(msg).__name__)
            return
        if isinstance(msg, (Accept, Reject)) and len(self.links) > 1:
            msg = msgspec.structs.replace(msg, foreign=self.foreign(link))
        await link.send(msg)

    async def push(self, msg: Msg) -> None:
        """Token batches and preemptions to the PULL socket of each request's gateway."""
        if isinstance(msg, Preempted):
            if (link := self.link_for(msg.request_id)) is not None:
                await link.push(msg)
            return
        assert isinstance(msg, TokenBatch)
        if len(self.links) == 1:
            await self.links[0].push(msg)
            return
        per: dict[int, list[int]] = {}
        for i, rid in enumerate(msg.request_ids):
            # a silent gateway's too: one that was only paused reads them when it wakes (a
            # dead one's queue goes with its requests at the grace's end)
            if (link := self.link_for(rid)) is not None:
                per.setdefault(id(link), []).append(i)
        for one in self.links:
            if (rows := per.get(id(one))) is not None:
                await one.push(TokenBatch(
                    node_id=msg.node_id,
                    request_ids=[msg.request_ids[i] for i in rows],
                    token_ids=[msg.token_ids[i] for i in rows],
                    indices=[msg.indices[i] for i in rows],
                    finish_reasons=[msg.finish_reasons[i] for i in rows],
                ))  # fmt: skip
