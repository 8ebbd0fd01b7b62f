"""Cross-node prefix reuse: a prefill node brings prefix blocks from a peer's cache instead of
computing them.

The gateway's offer names the node whose cache holds most of the prompt's leading blocks when
that is more than this node holds (`PrefillOffer.fetch_from`, from its prefix index). The
node fetches when the estimate says that is faster: the KV bytes of the missing tokens at the
measured fetch bandwidth, against the measured prefill time per token (moving averages; until
a prefill is measured, fetching is the bet, as it is on every device we know).

Fetcher: the request is accepted but not scheduled yet; its local prefix blocks are pinned
and a `KvFetch` goes to the holder's data socket. The holder's KV comes back as an ordinary
transfer (`KvHeader.fetch`) into blocks reserved here, by whichever KV backend suits the pair.
Once complete, the blocks are registered in the prefix cache, stay pinned, and the request is
scheduled: admission finds its prefix cached. The pins go when its prefill is scheduled, or
when it ends. If the holder refuses (the blocks went), or the fetch stops making progress
(the holder died), the request is scheduled anyway and computes what it lacks: a fetch only
ever saves work, never fails a request.

Holder (any node with a data plane): pins the blocks of the asked prefix it still holds past
what the fetcher has (refused where that would eat into the room it keeps free) and sends
them through its KV sender like any transfer; unpins on the fetcher's KvAck or KvRefuse, or
after a long deadline (the fetcher died).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence as Blocks
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.common.config import NodeConfig
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import SeqStatus, Sequence
from pdserve.common.kv.base import Intake
from pdserve.common.kv.intake import KvIntake
from pdserve.common.kv.sender import KvSender, TransferEnded
from pdserve.common.node.reserve import reserve_blocks
from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.prefix import token_ids_problem
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import (
    PREFIX_GONE,
    KvFetch,
    KvHeader,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
    PrefillOffer,
)


class Wakes(Protocol):
    def wake(self) -> None: ...


class Promises(Protocol):
    def promised_blocks(self) -> int: ...


class HoldsBlocks(Protocol):
    blocks: BlockManager

    @property
    def steps(self) -> Wakes: ...


def free_and_wake(node: HoldsBlocks, blocks: Blocks[int]) -> None:
    """Give blocks back to the cache and wake the step loop: it sleeps until something may be
    schedulable, so a prompt waiting for room would sleep on beside the freed blocks."""
    if blocks:
        node.blocks.free(blocks)
        node.steps.wake()


class FetchHost(Protocol):
    """What fetches need of their node: its requests, cache and scheduler, and a wake-up."""

    cfg: NodeConfig
    engine: Engine
    blocks: BlockManager
    scheduler: Scheduler
    node_id: str
    requests: dict[str, Any]  # wire id -> NodeRequest (.seq)
    token_cost: float  # measured seconds per prefilled token
    metrics: NodeMetrics

    @property
    def steps(self) -> Wakes: ...
    @property
    def role(self) -> Promises: ...
    def spawn(self, coro: Any) -> None: ...


class FetchPlane(Protocol):
    """The data plane fetches travel on (kv.py)."""

    sender: KvSender
    intake: KvIntake

    def target(self) -> DecodeTarget: ...


log = logging.getLogger(__name__)
LATENCY_S = 0.002  # a fetch's fixed cost: KvFetch to the holder, its staging, the header back


@dataclass
class _Fetch:
    request_id: str
    seq: Sequence
    holder: DecodeTarget
    skip: int  # leading tokens this node holds (their blocks pinned in `local`)
    tokens: int  # tokens asked for (whole blocks)
    local: list[int]
    started: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None
    reserved: int = 0  # blocks, once the header came: the intake owns them until it lands


def fetch_id(request_id: str) -> str:
    return f"{request_id}/fetch"


class PrefixFetches:
    def __init__(self, node: FetchHost, kv: FetchPlane) -> None:
        self.node = node
        self.kv = kv
        self.enabled = node.cfg.kv_fetch == "on" and node.scheduler.cfg.prefix_caching
        self.stall_s = min(2.0, node.cfg.kv_transfer_timeout)
        # a holder unpins what it serves 3 x --kv-transfer-timeout after our KvFetch reached
        # it (`serve`): frames still in flight then would read blocks it may have reused, and
        # we would cache those bytes as the prefix. A fetch still landing at 2 x is given up
        # (the cluster's nodes share the flag); one that slow is no faster than computing
        self.limit_s = 2 * node.cfg.kv_transfer_timeout
        self.fetching: dict[str, _Fetch] = {}  # by fetch id
        self.pins: dict[str, list[int]] = {}  # request id -> fetched blocks, until scheduled
        self.serving: dict[str, tuple[list[int], asyncio.TimerHandle]] = {}  # fetch id ->
        self.seconds_per_byte = 1e-9  # measured per fetch; a guess of 1 GB/s until then
        self.fetched_tokens = 0  # since start (Load.prefix_fetched)
        node.scheduler.held_blocks = self.held_blocks

    # -- fetcher ------------------------------------------------------------------------------
    def estimate(self, tokens: int) -> float:
        engine = self.node.engine
        nbytes = engine.kv_store.frame_bytes(tokens) * engine.kv_store.num_layers
        return LATENCY_S + nbytes * self.seconds_per_byte

    def start(self, seq: Sequence, offer: PrefillOffer) -> bool:
        """Fetch the prefix the offer's hint names, if worth it; False: schedule as usual."""
        holder, bm = offer.fetch_from, self.node.blocks
        if not self.enabled or holder is None or holder.node_id == self.node.node_id:
            return False
        bs = bm.block_size
        want = min(offer.fetch_tokens, (seq.num_tokens - 1) // bs * bs)
        local = bm.match(bm.hashes(seq.token_ids[: want - want % bs]))
        skip = len(local) * bs
        gain = want - skip
        cost = self.node.token_cost
        if gain < bs or (cost and self.estimate(gain) >= gain * cost):
            return False
        fid = fetch_id(seq.seq_id)
        bm.take(local)  # kept until the header reserves the rest
        f = _Fetch(seq.seq_id, seq, holder, skip, want, local)
        self.fetching[fid] = f
        prompt = seq.token_ids[:want]
        self.kv.sender.send_message(
            holder,
            KvFetch(request_id=fid, prompt_ids=prompt, skip_tokens=skip, reply_to=self.kv.target()),
        )
        wait = min(max(self.stall_s, 4 * self.estimate(gain)), self.limit_s)
        f.timer = asyncio.get_running_loop().call_later(wait, self._check, fid)
        log.debug("%s fetches %d tokens from %s (%d local)", seq.seq_id, gain, holder.node_id, skip)
        return True

    def reserve(self, h: KvHeader) -> list[int] | str:
        """Blocks for a fetch's KV: those we pinned, then new ones."""
        f = self.fetching.get(h.request_id)
        n, bm = len(h.prompt_ids), self.node.blocks
        if f is None or f.reserved or h.prefill_node != f.holder.node_id:
            return "no such fetch"
        if (
            h.skip_tokens != f.skip
            or n % bm.block_size
            or not f.skip < n <= f.tokens
            or h.frame_bytes != self.node.engine.kv_store.frame_bytes(n - f.skip)
            or h.prompt_ids != f.seq.token_ids[:n]
        ):
            self._fail(h.request_id, "KV layout mismatch")
            return "KV layout mismatch"
        table = reserve_blocks(bm, h.prompt_ids, f.skip, n, 0)
        if isinstance(table, str):
            self._fail(h.request_id, table)
            return table
        bm.free(f.local)  # `reserve_blocks` took them again, for the intake
        f.local, f.reserved = [], len(table)
        return table

    def landed(self, intake: Intake) -> None:
        """Every layer of a fetch is here: its blocks join the prefix cache, the request
        goes to the scheduler."""
        h, bm = intake.header, self.node.blocks
        f = self.fetching.pop(h.request_id, None)
        req = self.node.requests.get(f.request_id) if f is not None else None
        if f is None or req is None or req.seq is not f.seq:
            free_and_wake(self.node, intake.block_table)  # abandoned meanwhile
            return
        if f.timer is not None:
            f.timer.cancel()
        if time.monotonic() - f.started > self.limit_s:  # landed past its holder's pin
            free_and_wake(self.node, intake.block_table)
            self._fall_back(f, f"landed after {self.limit_s:g} s")
            return
        bm.register(intake.block_table, bm.hashes(h.prompt_ids))
        self.pins[f.request_id] = intake.block_table
        seconds = time.monotonic() - f.started
        if intake.bytes_in:
            self.seconds_per_byte = 0.7 * self.seconds_per_byte + 0.3 * seconds / intake.bytes_in
        self.node.metrics.fetch("fetched")
        self.fetched_tokens += len(h.prompt_ids) - f.skip
        self._schedule(f)

    def refused(self, fid: str, peer: str, why: str) -> None:
        """The holder will not send (its blocks went, or it refused our KvFetch)."""
        f = self.fetching.get(fid)
        if f is not None and f.holder.node_id == peer:
            self._fail(fid, why)

    def _check(self, fid: str) -> None:
        """The fetch's deadline: go on waiting while its frames keep landing."""
        f = self.fetching.get(fid)
        if f is None:
            return
        rec = self.kv.intake.incoming.get(fid)
        now = time.monotonic()
        if now - f.started > self.limit_s:
            self._fail(fid, f"still landing after {self.limit_s:g} s")
            return
        if (
            rec is not None
            and not rec.dropped
            and now - (rec.progress or rec.started) < self.stall_s
        ):
            f.timer = asyncio.get_running_loop().call_later(self.stall_s / 4, self._check, fid)
            return
        self._fail(fid, "no progress")

    def _fail(self, fid: str, why: str) -> None:
        """Give up the fetch: the request computes its prefix."""
        f = self._abandon(fid)
        if f is not None:
            self._fall_back(f, why)

    def _fall_back(self, f: _Fetch, why: str) -> None:
        log.info(
            "fetch of %s from %s failed (%s): recomputing", f.request_id, f.holder.node_id, why
        )
        self.node.metrics.fetch("fell_back")
        self._schedule(f)

    def _abandon(self, fid: str) -> _Fetch | None:
        f = self.fetching.pop(fid, None)
        if f is None:
            return None
        if f.timer is not None:
            f.timer.cancel()
        if f.reserved:  # the intake holds the blocks: drop them and tell the holder
            rec = self.kv.intake.incoming.get(fid)
            if rec is not None and self.kv.intake.drop(fid):
                self.node.spawn(self.kv.intake.refuse(rec.peer, fid, "fetch abandoned"))
        else:
            free_and_wake(self.node, f.local)
        return f

    def _schedule(self, f: _Fetch) -> None:
        req = self.node.requests.get(f.request_id)
        if req is not None and req.seq is f.seq:
            self.node.scheduler.add(f.seq)
            self.node.steps.wake()

    def held_blocks(self) -> int:
        """Blocks held for prompts the scheduler is to admit (a fetched prefix: the local part
        pinned, the reservation landing, or the landed blocks pinned till scheduled). The
        scheduler's promise for those prompts is their whole KV: held, these count once."""
        held = sum(f.reserved or len(f.local) for f in self.fetching.values())
        for rid, blocks in self.pins.items():  # landed: until its prefill is scheduled
            req = self.node.requests.get(rid)
            if req is not None and req.seq.status is SeqStatus.WAITING:
                held += len(blocks)
        return held

    def unpin(self, request_id: str) -> None:
        """The request's prefill was scheduled (it took the blocks itself), or it ended."""
        free_and_wake(self.node, self.pins.pop(request_id, []))

    def cancel(self, request_id: str) -> None:
        """The request ended (abort, lease): whatever it fetched or is fetching goes."""
        self._abandon(fetch_id(request_id))
        self.unpin(request_id)

    # -- holder -------------------------------------------------------------------------------
    async def serve(self, peer: bytes, msg: KvFetch) -> None:
        """A peer asks for a prefix of ours: send what we still hold of it."""
        fid, node, bm = msg.request_id, self.node, self.node.blocks
        n, skip, bs = len(msg.prompt_ids), msg.skip_tokens, bm.block_size
        hits: list[int] = []
        problem: str | None = None
        if peer != msg.reply_to.node_id.encode():
            problem = "reply_to is not the asking node"
        elif fid in self.serving or fid in self.kv.sender.transfers:
            problem = "duplicate fetch id"
        elif n % bs or skip % bs or not 0 <= skip < n or n > node.engine.max_model_len:
            problem = "malformed fetch"
        elif (bad := token_ids_problem(msg.prompt_ids, self.kv.intake.vocab_size)) is not None:
            problem = f"malformed fetch: {bad}"  # else unhashable
        else:
            hits = bm.match(bm.hashes(msg.prompt_ids)) if node.scheduler.cfg.prefix_caching else []
            if len(hits) * bs <= skip:
                problem = f"{PREFIX_GONE}: {len(hits) * bs} tokens here"
            else:
                problem = self._no_room_to_pin(hits[skip // bs :])
        if problem is not None:
            await self.kv.intake.refuse(peer, fid, problem)
            return
        have = len(hits) * bs
        sent = hits[skip // bs :]  # the peer holds the rest: these alone are read and sent
        bm.take(sent)
        loop = asyncio.get_running_loop()
        self.serving[fid] = (
            sent,
            loop.call_later(3 * node.cfg.kv_transfer_timeout, self._expire, fid),
        )
        sender = self.kv.sender
        prompt = msg.prompt_ids[:have]
        try:
            t = sender.begin(
                fid, msg.reply_to, prompt, have, SamplingParams(), hits, skip=skip, fetch=True
            )
        except Exception as exc:  # else pinned till _expire, and the fetcher waits as long
            log.exception("sending fetch %s failed", fid)
            self.served(fid, acked=False)  # unpinned; nothing of it went out
            await self.kv.intake.refuse(peer, fid, f"cannot send: {exc!r}")
            return
        try:
            payloads = await asyncio.to_thread(sender.stage_all, t)  # reads pinned blocks only
        except TransferEnded:  # refused or expired meanwhile: unpinned there
            return
        except Exception:
            log.exception("staging fetch %s failed", fid)
            self._expire(fid)
            return
        if fid in self.serving:  # not refused meanwhile
            sender.push_all(t, payloads)
            sender.done(t, -1)

    def _no_room_to_pin(self, blocks: list[int]) -> str | None:
        """Why pinning `blocks` for a peer would cost this node room it keeps (the watermark,
        accepted prompts'): those idle in the cache leave the free queue until the peer acks;
        on a decode node too few free blocks preempt live streams, on a prefill node the
        prompts it accepted wait. None: room."""
        bm, node = self.node.blocks, self.node
        idle = sum(1 for b in blocks if bm.ref_counts[b] == 0)
        # the role's promise (a decode node's local prompts) or the scheduler's (the prompts
        # a prefill node accepted, waiting or fetching): the same prompts where both count
        accepted = node.scheduler.promised([f.seq for f in self.fetching.values()])
        keep = node.scheduler.cfg.watermark_blocks + max(node.role.promised_blocks(), accepted)
        if bm.can_allocate(idle, reserve=keep):
            return None
        return f"no room to pin {idle} KV blocks ({bm.num_free_blocks} free, {keep} kept)"

    def served(self, fid: str, acked: bool) -> bool:
        """The fetcher acknowledged (or refused) a fetch we served: unpin. False: not ours."""
        entry = self.serving.pop(fid, None)
        if entry is None:
            return False
        hits, timer = entry
        timer.cancel()
        self.kv.sender.release(fid)
        free_and_wake(self.node, hits)  # a prompt that did not fit beside them may now
        if acked:
            self.node.metrics.fetch("served")
        return True

    def _expire(self, fid: str) -> None:
        entry = self.serving.pop(fid, None)
        if entry is not None:
            entry[1].cancel()
            self.kv.sender.abort(fid)
            free_and_wake(self.node, entry[0])

    def close(self) -> None:
        for f in self.fetching.values():
            if f.timer is not None:
                f.timer.cancel()
        for _, timer in self.serving.values():
            timer.cancel()
