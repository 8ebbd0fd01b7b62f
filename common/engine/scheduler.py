"""Continuous-batching scheduler for one engine doing prefill and decode. Pure Python.

Each step has a token budget: `chunk_size` with chunked prefill, else `max_batch_tokens`.
Running sequences that are decoding go first, one token each, so a long prompt never
delays a decode step by more than the budget allows. The remaining budget goes to
prefills, oldest first: partially prefilled sequences, then waiting ones. Without chunking a
prompt is prefilled whole (alone if it exceeds the budget, so nothing starves); with
chunking it is cut to the remaining budget. A sequence gets blocks for its whole prompt at
admission, only while `watermark_blocks` stay free for running sequences to grow (vLLM's
watermark). When a decoding sequence cannot grow anyway, the newest running sequence is
preempted: its blocks are freed and it goes back to the head of the queue, to be prefilled
again from prompt + generated tokens (recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_batch_tokens: int
    chunk_size: int  # 0 = no chunked prefill
    num_blocks: int
    block_size: int
    watermark_blocks: int = 0


@dataclass
class SchedulerOutput:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is the newest

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        needed = self.block_manager.blocks_needed(seq.num_tokens + 1)
        if needed > self.cfg.num_blocks - self.cfg.watermark_blocks:
            raise ValueError(
                f"a {seq.num_tokens}-token prompt needs {needed} KV blocks; the cache has "
                f"{self.cfg.num_blocks}"
            )
        self.waiting.append(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """A sequence whose KV arrived from elsewhere (a decode node's intake): it already
        holds its blocks and decodes from the next step on."""
        assert seq.block_table and seq.num_computed_tokens == seq.num_tokens - 1
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.chunk_size or self.cfg.max_batch_tokens
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            if budget < 1:
                break
            if self._make_room(seq, out):
                out.decodes.append(seq)
                budget -= 1
        candidates = [s for s in self.running if s.is_prefilling] + list(self.waiting)
        for seq in candidates:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if self.cfg.chunk_size:
                n = min(remaining, budget)
            else:
                n = remaining
                if n > budget and not out.empty:
                    break
            if n <= 0:
                break
            if seq.status is SeqStatus.WAITING and not self._admit(seq):
                break
            out.prefills.append((seq, n))
            budget -= n
        return out

    def _admit(self, seq: Sequence) -> bool:
        if len(self.running) >= self.cfg.max_num_seqs:
            return False
        bm = self.block_manager
        need = bm.blocks_needed(seq.num_tokens) - len(seq.block_table)
        if not bm.can_allocate(need, reserve=self.cfg.watermark_blocks):
            return False
        seq.block_table.extend(bm.allocate(need))
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
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []

    def on_step_done(self, out: SchedulerOutput, tokens: list[int]) -> list[Sequence]:
        """Record computed tokens and append sampled ones; returns the sequences that grew."""
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
        return grew
