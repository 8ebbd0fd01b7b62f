"""Continuous-batching scheduler for one engine, in the mode of its node's role. Pure Python.

Each step has a token budget: `chunk_size` with chunked prefill, else `max_batch_tokens`.
Running sequences that are decoding go first, one token each, so a long prompt never
delays a decode step by more than the budget allows. The remaining budget goes to
prefills, oldest first: partially prefilled sequences, then waiting ones. Without chunking
a prompt is prefilled whole (alone if past the budget: nothing starves); with chunking it
is cut to the remaining budget. A sequence gets blocks for its whole prompt at admission,
only while `watermark_blocks` stay free for running sequences to grow (vLLM's watermark).
When a decoding sequence cannot grow anyway, the newest running one is preempted (freed).

Prefix caching (`prefix_caching`, the mixin in prefix_caching.py): a sequence admitted with
no KV yet takes the blocks holding the longest cached prefix of its tokens (chained block
hashes, block_manager.py; a prefix continuing on the disk tier is read ahead, the sequence
left waiting meanwhile) and computes the rest, at least its last token (its logits are
needed). Every full block whose KV is computed (or arrived, in decode mode) is registered:
reusable after its sequence ends, until taken for other tokens (least recently freed first).

Modes (one scheduler for every role, so a node could serve either):
    colocated  both phases here; a preempted sequence goes back to the head of the queue,
               to be prefilled again from prompt + generated tokens (recompute).
    prefill    prompts only. A sequence whose prefill completed leaves the batch but keeps
               its blocks (`parked`) until its KV is handed off (`release`). `can_take`
               answers offers at once: on demand (P/D-Serve), only while the batch
               (waiting + prefilling) is below `max_num_seqs` and within `max_batch_tokens`
               and the free KV; with `ahead` (--prefill-ahead), while the next batch
               (waiting) is, so it forms during the running pass; queueing (the baseline
               policies), whenever it could ever fit.
    decode     sequences arrive prefilled (`admit_prefilled`) and every running one decodes at
               each step: its KV is its admission. The budget bounds only the prompts the
               node prefills itself (--local-prefill), so a burst of them stalls the streams
               by one budget a step. A preempted one is handed back (out.preempted, not
               requeued): the gateway re-places it elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.common.config import EngineConfig
from pdserve.common.engine.block_manager import BlockManager, hash_salt
from pdserve.common.engine.pass_order import count_overtakes, shortest_first
from pdserve.common.engine.prefix_caching import PrefixCaching
from pdserve.common.engine.sequence import SeqStatus, Sequence
from pdserve.common.engine.tiers import TierStore

Mode = Literal["colocated", "prefill", "decode"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batch_tokens: int
    chunk_size: int  # 0 = no chunked prefill
    num_blocks: int
    block_size: int
    watermark_blocks: int = 0
    mode: Mode = "colocated"
    prefix_caching: bool = False
    hash_salt: bytes = b""  # the root of block hashes: model, dtype, block size
    record_events: bool = False  # queue stored/evicted hashes for the node to publish
    ahead: bool = False  # prefill, on demand: the batch limits bound the next pass alone
    # prefill, on demand (pass_order.py): waiting prompts shortest first, and several in
    # one pass only up to this many tokens; 0 = arrival order, passes up to max_batch_tokens
    pass_tokens: int = 0

    @classmethod
    def of(
        cls,
        cfg: EngineConfig,
        num_blocks: int,
        block_size: int,
        mode: Mode,
        model_id: str = "",
        record_events: bool = False,
    ) -> SchedulerConfig:
        """From an engine's settings (its batch limits, chunking, watermark, caching)."""
        dtype = cfg.numerics  # the KV depends on the dtype and the weights' quantization
        return cls(
            max_num_seqs=cfg.max_batch,
            max_batch_tokens=cfg.max_batch_tokens,
            chunk_size=cfg.chunk_size,
            num_blocks=num_blocks,
            block_size=block_size,
            watermark_blocks=int(cfg.watermark * num_blocks),
            mode=mode,
            prefix_caching=cfg.prefix_caching == "on",
            hash_salt=hash_salt(model_id, dtype, block_size),
            record_events=record_events,
            ahead=cfg.prefill_ahead == "on",
            pass_tokens=cfg.prefill_pass_tokens if mode == "prefill" else 0,
        )


@dataclass
class SchedulerOutput:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def seq_ids(self) -> set[str]:
        return {s.seq_id for s, _ in self.prefills} | {s.seq_id for s in self.decodes}


class Scheduler(PrefixCaching):
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.block_manager = BlockManager(
            cfg.num_blocks, cfg.block_size, cfg.hash_salt, cfg.record_events and cfg.prefix_caching
        )
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, found cached (here or in a lower tier)
        self.tiers: TierStore | None = None
        self._write_block: Callable[[int, bytes], None] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is the newest
        self.parked: dict[str, Sequence] = {}  # prefill mode: prefilled, KV held for handoff
        self.held_blocks: Callable[[], int] = lambda: 0  # the node's prefix fetches' (fetch.py)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- admission ----------------------------------------------------------------------
    def can_take(
        self, num_tokens: int, queueing: bool, pending: Iterable[Sequence] = ()
    ) -> str | None:
        """Prefill mode: None to accept a prompt of `num_tokens` now, else the reason not to.
        `pending`: accepted sequences the node has not handed to the scheduler yet (their
        prefix is being fetched); they count as waiting."""
        need = self.block_manager.blocks_needed(num_tokens)
        if num_tokens > self.largest_prompt:  # what `add` refuses
            return f"prompt of {num_tokens} tokens exceeds this node's KV cache"
        if queueing:
            return None
        pending = list(pending)
        batch = self.next_batch(pending)
        if len(batch) >= self.cfg.max_num_seqs:
            return f"batch full ({len(batch)}/{self.cfg.max_num_seqs})"
        tokens = sum(s.num_tokens for s in batch)
        if batch and tokens + num_tokens > self.cfg.max_batch_tokens:
            return f"token budget ({tokens} + {num_tokens} > {self.cfg.max_batch_tokens})"
        if need > self.block_manager.num_free_blocks - self.promised(pending):
            return "KV cache full (transfers in flight)"
        return None

    def next_batch(self, pending: list[Sequence]) -> list[Sequence]:
        """What an offer joins: the batch being computed and the one after it; with `ahead`,
        only the one after it (the running pass's sequences leave when it ends, so the next
        pass forms while it runs and an accepted prompt waits at most the rest of it)."""
        if self.cfg.ahead:
            return [*self.waiting, *pending]
        return [*self.running, *self.waiting, *pending]

    @property
    def largest_prompt(self) -> int:
        """The longest prompt `add` takes: its KV and the first token's, within the cache
        less the watermark."""
        usable = self.cfg.num_blocks - self.cfg.watermark_blocks
        return max(0, usable * self.block_manager.block_size - 1)

    def fit(self, max_model_len: int) -> int:
        """The context limit an engine with this cache can keep: a sequence grown past what
        the cache less the watermark holds could never be admitted again once preempted (it
        stayed at the head of the queue, and every later request waited behind it), so it
        ends at that length ("length"), and the gateway refuses what cannot fit (vLLM
        refuses to start with a max_model_len its cache cannot hold)."""
        return min(max_model_len, self.largest_prompt)

    def room(self, queueing: bool, pending: Iterable[Sequence] = ()) -> int:
        """Prefill mode: the longest prompt (tokens) `can_take` accepts now: 0 when the batch
        is full. The gateway skips offering longer prompts to this node until it next has
        news of it (gateway/placement.py)."""
        bm = self.block_manager
        most = self.largest_prompt
        if queueing:
            return most
        pending = list(pending)
        batch = self.next_batch(pending)
        if len(batch) >= self.cfg.max_num_seqs:
            return 0
        if batch:
            most = min(most, self.cfg.max_batch_tokens - sum(s.num_tokens for s in batch))
        free = bm.num_free_blocks - self.promised(pending)
        return max(0, min(most, free * bm.block_size))

    def promised(self, pending: list[Sequence]) -> int:
        """Free blocks the accepted prompts will take: less those already held for them
        (`held_blocks`: a fetched prefix, out of the free queue, admission takes as cached)."""
        need = self.block_manager.blocks_needed
        return sum(need(s.num_tokens) for s in [*self.waiting, *pending]) - self.held_blocks()

    def add(self, seq: Sequence) -> None:
        # a finished one (aborted before it was added) would be scheduled with no blocks
        assert seq.status is SeqStatus.WAITING, (seq.seq_id, seq.status)
        needed = self.block_manager.blocks_needed(seq.num_tokens + 1)
        if needed > self.cfg.num_blocks - self.cfg.watermark_blocks:
            raise ValueError(f"a {seq.num_tokens}-token prompt needs {needed} KV blocks; the "
                             f"cache has {self.cfg.num_blocks}")  # fmt: skip
        self.waiting.append(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """Decode mode: a sequence whose KV arrived from elsewhere (a decode node's intake):
        it already holds its blocks and decodes from the next step on."""
        assert seq.block_table and seq.num_computed_tokens == seq.num_tokens - 1
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._register(seq)  # the prompt's KV is here now: reusable by a later turn

    # -- endings ------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence is done (or aborted) wherever it is: its blocks are freed."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_reads(seq)  # wherever it was: its blocks read ahead let go, not kept
        self.parked.pop(seq.seq_id, None)
        self._release(seq)

    def park(self, seq: Sequence) -> bool:
        """Decode mode: take a running sequence off the batch, its blocks held, to hand its
        KV to another decode node (live migration; `release` once it is acknowledged)."""
        if seq not in self.running or seq.is_prefilling:  # a prompt in chunks: no KV to move
            return False
        self.running.remove(seq)
        self.parked[seq.seq_id] = seq
        return True

    def resume(self, seq_id: str) -> bool:
        """Decode mode: a parked sequence that found nowhere to go decodes on here."""
        seq = self.parked.pop(seq_id, None)
        if seq is None:
            return False
        self.running.append(seq)
        return True

    def release(self, seq_id: str) -> Sequence | None:
        """Prefill mode: the parked sequence's KV was handed off; free its blocks."""
        seq = self.parked.pop(seq_id, None)
        if seq is not None:
            self.finish(seq, "handed_off")
        return seq

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.chunk_size or self.cfg.max_batch_tokens
        charged = self.cfg.mode != "decode"  # a decode node's decodes take no budget
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            if budget < 1 and charged:
                break
            if self._make_room(seq, out):
                out.decodes.append(seq)
                budget -= int(charged)
        arrived = list(self.waiting)
        queue = shortest_first(arrived) if self.cfg.pass_tokens else arrived
        candidates = [s for s in self.running if s.is_prefilling] + queue
        pass_tokens = 0
        for seq in candidates:
            waiting = seq.status is SeqStatus.WAITING
            hits, loads = self._cached_prefix(seq) if waiting else ([], [])
            if loads and not self._tiers_ready(seq, loads):
                continue  # its disk blocks are read off the loop first; the others go on
            cached = (len(hits) + len(loads)) * self.cfg.block_size
            remaining = seq.num_tokens - seq.num_computed_tokens - cached
            if self.cfg.chunk_size:
                n = min(remaining, budget)
            else:
                n = remaining
                # past the budget, a prompt goes with no other prompt; the decodes still run
                # beside it (waiting for none to run held it, and every request behind it,
                # until the longest generation ended)
                if n > budget and out.prefills:
                    break
            if n <= 0:
                break
            if self.cfg.pass_tokens and out.prefills and pass_tokens + n > self.cfg.pass_tokens:
                break
            if waiting and not self._admit(seq, hits, loads):
                break
            if waiting and loads:  # a tier's block may be gone by now (pushed out by this very
                # allocation's evictions, or corrupt): what did not load is computed now too,
                # in this pass (a prefill node sends a prompt's KV after its one pass), even
                # past the step's budget by those blocks
                left = seq.num_tokens - seq.num_computed_tokens
                n = min(left, budget) if self.cfg.chunk_size else left
            out.prefills.append((seq, n))
            budget -= n
            pass_tokens += n
        if self.cfg.pass_tokens:
            count_overtakes(arrived, out.prefills)
        return out

    def on_step_done(self, out: SchedulerOutput, tokens: list[int]) -> list[Sequence]:
        """Record computed tokens and append sampled ones; returns the sequences that grew.
        In prefill mode those leave the batch for the parking lot, blocks kept."""
        grew: list[Sequence] = []
        for seq, n in out.prefills:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                grew.append(seq)
        for seq in out.decodes:
            seq.num_computed_tokens += 1
            grew.append(seq)
        assert len(grew) == len(tokens), (len(grew), len(tokens))
        for seq, token in zip(grew, tokens, strict=True):
            seq.token_ids.append(token)
        for seq in [s for s, _ in out.prefills] + out.decodes:
            self._register(seq)
        if self.cfg.mode == "prefill":
            for seq in grew:
                self.running.remove(seq)
                seq.status = SeqStatus.PREFILLED
                self.parked[seq.seq_id] = seq
        return grew

    # -- internals ----------------------------------------------------------------------
    def _admit(self, seq: Sequence, hits: list[int], loads: list[bytes]) -> bool:
        if len(self.running) >= self.cfg.max_num_seqs:
            return False
        bm = self.block_manager
        need = bm.blocks_needed(seq.num_tokens) - len(hits)
        idle_hits = sum(1 for b in hits if bm.ref_counts[b] == 0)  # cached: in the free queue
        if not bm.can_allocate(need + idle_hits, reserve=self.cfg.watermark_blocks):
            return False
        bm.take(hits)
        fresh = bm.allocate(need)
        loaded = self._load(fresh, loads)
        self._release_reads(seq)  # loaded, or not needed: read ahead for it no more
        seq.block_table = [*hits, *fresh]
        cached = len(hits) + loaded
        seq.num_computed_tokens = seq.num_cached_tokens = cached * self.cfg.block_size
        seq.num_registered_blocks = len(hits)
        if self.cfg.prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING
        return True

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Grow seq's blocks to hold its newest token, preempting the newest others if needed."""
        while not self.block_manager.grow(seq.block_table, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        out.preempted.append(seq)
        if self.cfg.mode == "decode":  # handed back: it is re-placed elsewhere
            seq.status = SeqStatus.PREEMPTED
            return
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
            seq.num_registered_blocks = 0
