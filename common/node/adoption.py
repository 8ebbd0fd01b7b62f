"""Streams that outlive their gateway (docs/architecture.md, "Several gateways"): a request
whose gateway is silent or gone, or let it go when its client left (`Release`), is an
orphan. The node keeps it, decoding on, for `--orphan-grace` seconds; a finished orphan's
tokens are kept as long. A client that lost its gateway or connection asks a gateway to
resume the stream; that gateway asks the nodes (`Adopt`), and the node holding the orphan
hands over its state (`Adopted`: prompt, every token so far) and sends it everything from
then on. Past the grace, orphans are freed, their KV with them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from pdserve.common.node.gateways import Gateways
from pdserve.common.node.links import GatewayLink, Gone
from pdserve.common.node.role import NodeRequest
from pdserve.common.wire.protocol import (
    FREED,
    REGISTERING,
    Adopt,
    Adopted,
    Load,
    Preempted,
    PrefillFailed,
    Release,
    Wanted,
)

log = logging.getLogger(__name__)

LIVE = "the stream is served by a live gateway"  # its gateway is told (`Wanted`)
GIVEN_BACK = "preempted"  # an ended orphan's reason: its adopter places it again


class AdoptHost(Protocol):
    @property
    def requests(self) -> dict[str, NodeRequest]: ...

    def free_stale(self, request_ids: tuple[str, ...]) -> None: ...

    def abort(self, rid: str) -> None: ...

    def load(self) -> Load: ...

    def unpark(self, rid: str) -> None: ...  # parked to move: decodes here again

    def adopted(self, rid: str) -> None: ...  # a running one: a draining node moves it on


class Adoption:
    def __init__(self, gateways: Gateways, node: AdoptHost, grace: float,
                 heartbeat_timeout: float = 2.0,
                 count: Callable[[str, int], None] = lambda outcome, n: None) -> None:  # fmt: skip
        self.gateways, self.node, self.grace = gateways, node, grace
        self.count = count  # pdserve:orphans_total{outcome}: adopted, freed_running/_ended
        self.finished: dict[str, tuple[NodeRequest, str]] = {}  # ended orphans: tokens kept
        # requests that ended for a live gateway in the last `window` seconds: its `Release`
        # may be on its way (its client left in the step the request ended in), or it may
        # have died before their last tokens reached it (seen only at its heartbeat timeout)
        self.window = max(5.0, 2 * heartbeat_timeout)
        self.recent: dict[str, tuple[NodeRequest, str, float, object]] = {}  # .., when, owner
        self.handed: set[str] = set()  # of `recent`, ended orphans a gateway adopted
        # `Wanted` sent: request id -> (asking gateway, serving gateway) -> when. Once per
        # pair per `window`: two clients resuming one stream at two gateways would bounce it
        # between them every round; one client moving between them again is told again
        self.told: dict[str, dict[tuple[str, str], float]] = {}
        # taken from a silent gateway's link, which may answer again as the same process
        # with them still in its table: wire id -> adopted by another gateway (else freed)
        self.taken: dict[GatewayLink, dict[str, bool]] = {}
        self.clock = time.monotonic

    def ended(self, req: NodeRequest, reason: str, now: float | None = None) -> None:
        """A request finished on this node: an orphan's tokens wait for its adopter."""
        now = time.monotonic() if now is None else now
        rid = req.seq.seq_id
        if rid in self.finished or rid in self.recent:
            return  # its gateway ended it first (a stop string, `release`): that is kept
        req = _slim(req)  # its tokens, not its block hashes: kept seconds, for thousands
        # a silent gateway's stays its own: its last tokens go out after this (a paused
        # gateway reads them when it wakes); `registered` makes it an orphan's then
        if self.gateways.owners.orphan(rid):
            self.finished[rid] = (req, reason)
            return
        self._trim(now)
        self.recent[rid] = (req, reason, now, self.gateways.owners.get(rid))

    def _trim(self, now: float) -> None:
        while self.recent and now - next(iter(self.recent.values()))[2] > self.window:
            del self.recent[next(iter(self.recent))]
        if self.handed:
            self.handed.intersection_update(self.recent)

    def registered(self, link: GatewayLink, gateway_id: str, now: float) -> bool:
        """`link`'s gateway registered as `gateway_id`. True: a new process, what the old one
        held is orphaned. The same one after a silence: what ended for it meanwhile stays an
        orphan, freed at the grace's end (its own `Release` would not find it)."""
        if link.gateway_id and gateway_id != link.gateway_id:
            self.retire(link, now)
            return True
        if link.silent_since is not None:
            owners = self.gateways.owners
            for rid in [r for r in self.finished if owners.get(r) is link]:
                owners.move(rid, self._gone(link, now))
        return False

    def silenced(self, link: GatewayLink, now: float | None = None) -> None:
        """`link`'s gateway is silent or gone: what ended for it lately may never have reached
        it (its last tokens went to a dead process); kept as ended orphans, for the grace.
        Owned by a `Gone` of their own: if that gateway answers again under the same id
        (it was slow, not dead), they stay orphans and are freed at the grace's end."""
        for rid in [rid for rid, (*_, owner) in self.recent.items() if owner is link]:
            req, reason, *_ = self.recent.pop(rid)
            self.finished[rid] = (req, reason)
            if reason == GIVEN_BACK:  # its Preempted may wait unread in a paused gateway:
                self.gateways.owners.move(rid, link)  # (the sweep forgot its owner since)
                if self.given_back(rid):  # as one given back while silent: its gateway's
                    continue  # still, told if it answers again, unless adopted meanwhile
            self.gateways.owners.move(rid, self._gone(link, now))

    def given_back(self, rid: str) -> bool:
        """An orphan given back (preempted, handed back), its tokens kept for an adopter:
        True if its gateway is silent, to be told when it answers again unless another
        adopts it meanwhile (a `Preempted` read then would have it placed again by both)."""
        owner = self.gateways.owners.get(rid)
        if isinstance(owner, GatewayLink) and owner.silent_since is not None:
            self.taken.setdefault(owner, {})[rid] = False
            return True
        return False

    def retire(self, link: GatewayLink, now: float) -> None:
        """`link`'s gateway is no more (a new process under its address, or a vanished
        pod): what it held and what ended for it lately are orphans."""
        self.silenced(link, now)
        self.taken.pop(link, None)  # a new process has no table to tell
        self.gateways.retire(link, now)

    def _gone(self, link: GatewayLink, now: float | None) -> Gone:
        """The `Gone` of `link`'s silence (one per silence, not per stream)."""
        since = link.silent_since or now or time.monotonic()
        gone = self.gateways.gone[-1] if self.gateways.gone else None
        if gone is None or (gone.gateway_id, gone.since) != (link.gateway_id, since):
            gone = Gone(link.gateway_id, since)
            self.gateways.gone.append(gone)
        return gone

    def sweep(self, held: tuple[str, ...]) -> None:
        """Forget the owners of requests gone from the node, not of ended orphans: their
        tokens wait for an adopter (and the grace)."""
        self.gateways.owners.sweep({*held, *self.finished})
        self._trim(time.monotonic())
        for rid in [r for r in self.told if r not in self.gateways.owners.of]:
            del self.told[rid]

    async def on_gateway(self, msg: Adopt | Release, link: GatewayLink) -> None:
        if isinstance(msg, Release):
            self.release(msg.request_id, link, time.monotonic(), msg.tokens)
            return
        for wire_id, adopted in self.adopt(msg, link):
            await link.send(adopted)
            owner = self.gateways.owners.get(wire_id)
            if adopted.reason == LIVE and isinstance(owner, GatewayLink) and owner is not link:
                # served by a live gateway: its client has lost that connection, tell it
                pair, now = (link.gateway_id, owner.gateway_id), self.clock()
                told = self.told.setdefault(wire_id, {})
                if now - told.get(pair, -math.inf) > self.window:
                    told[pair] = now
                    await owner.send(Wanted(request_id=wire_id))

    def release(self, rid: str, link: GatewayLink, now: float, tokens: int = -1) -> None:
        """`link`'s gateway lets go of `rid`, a resumable stream whose client left or that
        ended: an orphan from now, for any gateway (that one too) to adopt within the grace.
        `tokens` >= 0: the gateway ended it after that many output tokens (a stop string):
        ended here too, those kept."""
        if rid in self.node.requests:
            if self.gateways.owners.get(rid) is not link:
                return
            if tokens >= 0:  # its KV is freed; what the client may not have is kept
                self.finished[rid] = (_upto(self.node.requests[rid], tokens), "stop")
                self.node.abort(rid)
        else:  # it ended before the Release came (its last step): its tokens are kept
            ended = self._ended_for(rid, link)
            if ended is None:
                if tokens >= 0 and self.gateways.owners.get(rid) is link:
                    self.node.abort(rid)  # its KV on its way here: the stop ended it
                return
            stop = tokens >= 0
            self.finished[rid] = (_upto(ended[0], tokens), "stop") if stop else ended
        gone = Gone(link.gateway_id, now)
        self.gateways.gone.append(gone)
        self.gateways.owners.move(rid, gone)
        log.info("%s released by the gateway at %s: kept for a resume", rid, link.address)

    def _ended_for(self, rid: str, link: GatewayLink) -> tuple[NodeRequest, str] | None:
        """`rid`, ended here for `link`'s gateway: lately, or while it was silent (an orphan
        of that gateway's id since it answered again; its Release times the grace anew)."""
        ended = self.recent.get(rid)
        if ended is not None and ended[3] is link:
            del self.recent[rid]
            return ended[0], ended[1]
        owner = self.gateways.owners.get(rid)
        mine = owner is link or (isinstance(owner, Gone) and owner.gateway_id == link.gateway_id)
        return self.finished[rid] if rid in self.finished and mine else None

    def adopt(self, msg: Adopt, link: GatewayLink) -> list[tuple[str, Adopted]]:
        """(wire id, answer) for each stream of `msg` this node holds (its latest attempt):
        adopted by `link`'s gateway if it is an orphan, else why not; none for the others.
        One pass over what the node holds, however many streams are asked for."""
        wanted = dict(msg.streams)
        held: dict[str, str] = {}  # request id -> its latest wire id here
        # an ended stream `link` adopted already: asked again, its reply was lost
        again = [r for r in self.handed if r in self.recent and self.recent[r][3] is link]
        for wire_id in (*self.node.requests, *self.finished, *again):
            rid = wire_id.rpartition(".")[0]
            if rid in wanted and (rid not in held or _attempt(wire_id) > _attempt(held[rid])):
                held[rid] = wire_id
        return [(w, self._adopt(rid, w, wanted[rid], link)) for rid, w in held.items()]

    def _adopt(self, asked: str, rid: str, have: int, link: GatewayLink) -> Adopted:
        owners = self.gateways.owners
        if link.silent_since is not None or not link.registered:
            return Adopted(request_id=asked, found=False, reason=REGISTERING)
        again = self.recent.get(rid) if rid in self.handed and rid not in self.finished else None
        # asked again (a lost reply): the same answer, even though it now has a live owner
        reasked = owners.get(rid) is link or (again is not None and again[3] is link)
        if not reasked and not owners.orphan(rid):
            return Adopted(request_id=asked, found=False, reason=LIVE)
        ended = self.finished.get(rid) or (again[:2] if again is not None else None)
        req, reason = ended if ended is not None else (self.node.requests[rid], None)
        seq = req.seq
        # a prefill node (its KV on its way), or a node prefilling it itself that has not made
        # this attempt's first token: its adopter would book it as decoding and drop the
        # FirstToken to come (the stream then stalls until its gap re-places it)
        if ended is None and (req.target is not None or seq.num_output_tokens == 0):
            return Adopted(request_id=asked, found=False, reason="in prefill")
        start = req.prompt_len or seq.num_prompt_tokens
        outputs = seq.token_ids[start:]
        if not 0 <= have <= len(outputs):
            return Adopted(request_id=asked, found=False,
                           reason=f"Last-Event-ID {have} is not a position of this stream "
                           f"(0 to {len(outputs)})")  # fmt: skip
        if not reasked:  # a stream saved, counted once
            self.count("adopted", 1)
        if ended is None and not reasked:  # parked for a move its dead gateway never ordered
            self.node.unpark(rid)  # (asked again: parked since by its adopter, moving)
        if isinstance(was := owners.get(rid), GatewayLink) and was is not link:
            self.taken.setdefault(was, {})[rid] = True  # a silent one's: told if it answers
        owners.move(rid, link)
        if ended is None and not reasked:
            self.node.adopted(rid)
        if self.finished.pop(rid, None) is not None:  # ended: its adopter may let it go again
            self._trim(time.monotonic())
            self.recent[rid] = (req, reason or "", time.monotonic(), link)
            self.handed.add(rid)
        log.info("%s adopted by the gateway at %s (%d tokens)", rid, link.address, len(outputs))
        return Adopted(
            request_id=rid, found=True, prompt_ids=seq.token_ids[:start], output_ids=outputs,
            base=seq.num_prompt_tokens - start, params=seq.params, finish_reason=reason,
            stream_format=req.stream_format,
        )  # fmt: skip

    def expire(self, now: float) -> None:
        """Free the orphans of gateways silent or gone for longer than the grace."""
        owners = self.gateways.owners
        late: list[str] = []
        silent: list[tuple[GatewayLink, list[str]]] = []
        for link in self.gateways.links:
            if link.silent_since is not None and now - link.silent_since > self.grace:
                owned = owners.owned(link)
                silent.append((link, owned))
                late += owned
        if self.gateways.gone:  # one pass: a released stream has a Gone of its own
            late += [r for r, o in owners.of.items() if isinstance(o, Gone)
                     and not o.freed and now - o.since > self.grace]  # fmt: skip
            self.gateways.gone = [g for g in self.gateways.gone if now - g.since <= self.grace]
        # running, or reserved with its KV on its way (a decode node's intake: the intake's
        # stall timer never starts for a reservation no frame reached)
        held = set(self.node.load().held) if late else set()
        live = tuple(r for r in late if r in held)
        for link, owned in silent:  # a running one is told its gateway if it answers again
            if running := [r for r in owned if r in held]:
                self.taken.setdefault(link, {}).update(dict.fromkeys(running, False))
        if late:  # nobody resumed them: a running one is lost to its client
            self.count("freed_running", len(live))
            self.count("freed_ended", len(late) - len(live))
        for rid in late:
            self.finished.pop(rid, None)
            # nobody's, and no orphan: an abort waits for a running step to end, and an
            # adopter taking it meanwhile got no token and no word ever again
            owners.move(rid, Gone("", now, freed=True))  # the sweep forgets it once freed
        if live:
            log.warning("freeing %d orphaned requests: no gateway adopted them within %.1f s",
                        len(live), self.grace)  # fmt: skip
            self.node.free_stale(live)


async def tell_returned(adoption: Adoption, link: GatewayLink, pushes_tokens: bool) -> None:
    """`link`'s gateway answers again as the same process after a silence: it still holds,
    in its table, what was taken from it meanwhile. A stream another gateway adopted (its
    client resumed there): `Wanted` (taken), so this one forgets it and hangs up the
    connection it streams on. One freed at the grace's end: given back to be placed again
    (`Preempted` on the token socket of a decode or colocated node; `PrefillFailed` from a
    prefill node), its client perhaps still waiting there; tokens of it that a step still
    holds may come after, and are dropped there as an old attempt's. One given back while it was
    silent goes the same way (its tokens, kept for an adopter, are no longer offered)."""
    node_id, owners = adoption.gateways.node_id, adoption.gateways.owners
    for rid, adopted in adoption.taken.pop(link, {}).items():
        if adopted:
            await link.send(Wanted(request_id=rid, taken=True))
            continue
        if adoption.finished.pop(rid, None) is not None:  # given back: its gateway's again,
            owners.move(rid, Gone("", time.monotonic(), freed=True))  # nobody else's to adopt
        if pushes_tokens:
            await link.push(Preempted(node_id=node_id, request_id=rid, reason=FREED))
        else:
            await link.send(PrefillFailed(request_id=rid, reason=FREED))


def _upto(req: NodeRequest, tokens: int) -> NodeRequest:
    """`req` as it was after `tokens` output tokens: what a stop string at its gateway kept
    (the node decodes a step or two past it before the gateway's word comes)."""
    seq, start = req.seq, req.prompt_len or req.seq.num_prompt_tokens
    kept = seq.token_ids[: max(start + tokens, seq.num_prompt_tokens)]
    return _slim(req, kept)


def _slim(req: NodeRequest, tokens: list[int] | None = None) -> NodeRequest:
    """A copy of an ended `req` with what a resume needs (its tokens), not its blocks."""
    kept = req.seq.token_ids if tokens is None else tokens
    seq = dataclasses.replace(req.seq, block_table=[], block_hashes=[], token_ids=kept)
    return dataclasses.replace(req, seq=seq)


def _attempt(wire_id: str) -> int:
    tail = wire_id.rpartition(".")[2]  # a wire id without one (a stray peer's): -1
    return int(tail) if "." in wire_id and tail.isdigit() else -1
