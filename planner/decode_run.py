"""Decode steps in runs: the planner's simulation steps a decode node many times per event.

Between events that change a decode node's batch (a KV arriving, a sequence ending, a
preemption) every step is alike: each running sequence gains one token, the step lasts
what the cost model says for the batch's total context (which grows by the batch size per
step), and a sequence takes a new KV block every `block_size` tokens. A `DecodeRun` knows
its steps' end times in advance and applies their effects to the node's own scheduler and
block manager only when something reads them (`to`), so one Python event stands for a run
of steps. What a step does is unchanged: the blocks are taken at a step's start, in the
batch's order, by `BlockManager.grow`, and full blocks are registered by
`Scheduler._register` at its end, step by step, as `schedule` and `on_step_done` would.

A run ends at the first step after which a sequence reaches its `max_tokens`, or just
before the first step that would find no free block (that step preempts: the simulation
runs it through the scheduler). Allocating blocks for an incoming request on the node
changes that bound: the simulation then cuts the run (`cut`) and plans a new one.
"""

from __future__ import annotations

import array
import functools
import zlib
from dataclasses import dataclass

from pdserve.common.costmodel import CostModel
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import Sequence

TOKEN = 1000  # the simulation's token id (no text is made)
VOCAB = 32_000  # ids a text prompt's tokens are drawn from


def prompt_tokens(prompt: list[int] | str, prompt_len: int) -> list[int]:
    """A workload prompt as token ids. A text (sharegpt) has no tokenizer here: token i
    stands for its UTF-8 bytes 4i..4i+3 (the workload's ~4 characters a token) and its id
    hashes the text up to there, so texts that begin alike share leading tokens (and
    prefix-cache blocks) as far as they agree, and other texts share none (one id for
    every token made every prompt a cache hit of every earlier one)."""
    if isinstance(prompt, list):
        return prompt
    return list(_text_tokens(prompt, max(1, prompt_len)))  # a text has a token at least


@functools.lru_cache(maxsize=4096)  # each candidate split replays the same workload
def _text_tokens(text: str, n: int) -> array.array:
    data, h, out = text.encode(), 0, array.array("i")  # 4 bytes a token kept, not 36
    for i in range(n):
        h = zlib.crc32(data[4 * i : 4 * i + 4] or i.to_bytes(4, "little"), h)
        out.append(TOKEN + h % VOCAB)
    return out


@dataclass(eq=False)
class DecodeRun:
    sched: Scheduler
    seqs: list[Sequence]  # the batch, in running order
    base: list[int]  # each sequence's num_tokens before the run's first step
    ends: list[float]  # each step's end time
    grows: list[list[int]]  # per residue of the step index mod block_size: who takes a block
    firsts: list[int]  # per sequence: the first step at which it takes a block
    registers: list[list[int]]  # per residue: who fills a block at that step's end
    done: int = 0  # steps whose end is applied
    started: int = 0  # steps whose start (blocks taken) is applied

    @property
    def steps(self) -> int:
        return len(self.ends)

    @property
    def end(self) -> float:
        return self.ends[-1]

    def to(self, now: float) -> bool:
        """Apply every step that ended by `now`; True if one did (the node's load report at
        the last one's end is due, before `begin`)."""
        ended = self.done
        while self.done < self.steps and self.ends[self.done] <= now:
            self._start_upto(self.done + 1)
            self._finish_step(self.done + 1)
            self.done += 1
        return self.done > ended

    def begin(self) -> None:
        """Apply the start of the step in flight (it took its blocks as it started)."""
        if self.done < self.steps:
            self._start_upto(self.done + 1)

    def cut(self) -> None:
        """End the run after the step in flight (a new run is planned from there)."""
        keep = self.done + (1 if self.started > self.done else 0)
        del self.ends[keep:]

    def flush(self) -> tuple[list[Sequence], list[float]]:
        """Write the applied steps' tokens into the sequences (bookkeeping that nothing
        reads mid-run); the sequences and the ended steps' times."""
        for i, seq in enumerate(self.seqs):
            self._tokens(i, self.done)
            seq.num_computed_tokens = self.base[i] - 1 + self.done
        return self.seqs, self.ends[: self.done]

    # -- internals --------------------------------------------------------------------------
    def _start_upto(self, step: int) -> None:
        bs = self.sched.cfg.block_size
        bm = self.sched.block_manager
        while self.started < step:
            k = self.started + 1
            for i in self.grows[k % bs]:
                if k >= self.firsts[i]:
                    seq = self.seqs[i]
                    ok = bm.grow(seq.block_table, self.base[i] + k - 1)
                    assert ok, "a run never outgrows the free blocks it was planned with"
            self.started = k

    def _finish_step(self, k: int) -> None:
        if not self.sched.cfg.prefix_caching:
            return
        for i in self.registers[k % self.sched.cfg.block_size]:
            seq = self.seqs[i]
            self._tokens(i, k)
            seq.num_computed_tokens = self.base[i] - 1 + k
            self.sched._register(seq)

    def _tokens(self, i: int, k: int) -> None:
        seq = self.seqs[i]
        short = self.base[i] + k - len(seq.token_ids)
        if short > 0:
            seq.token_ids.extend([TOKEN] * short)


def plan_run(
    sched: Scheduler, remaining: list[int], now: float, cost: CostModel, overhead: float
) -> DecodeRun | None:
    """A run of the decode node's batch from `now`, or None when its next step must go
    through the scheduler (it preempts, or a sequence lacks more than one block).
    `remaining`: per running sequence, the tokens it still makes."""
    seqs = list(sched.running)
    if not seqs or sched.waiting:
        return None
    bs = sched.cfg.block_size
    base = [s.num_tokens for s in seqs]
    firsts = []
    for seq, n in zip(seqs, base, strict=True):
        first = len(seq.block_table) * bs - n + 2  # the step whose start needs one more block
        if first < 1 or seq.is_prefilling:
            return None
        firsts.append(first)
    grows: list[list[int]] = [[] for _ in range(bs)]
    registers: list[list[int]] = [[] for _ in range(bs)]
    for i, (first, n) in enumerate(zip(firsts, base, strict=True)):
        grows[first % bs].append(i)
        registers[(1 - n) % bs].append(i)  # after step k it holds n - 1 + k computed tokens
    steps = min(remaining)
    free = sched.block_manager.num_free_blocks
    taken = 0
    for k in range(1, steps + 1):
        taken += sum(1 for i in grows[k % bs] if k >= firsts[i])
        if taken > free:
            steps = k - 1
            break
    if steps < 1:
        return None
    ends, t, batch, context = [], now, len(seqs), sum(base)
    for k in range(steps):
        t = t + cost.decode_batch_seconds(batch, context + batch * k) + overhead
        ends.append(t)
    return DecodeRun(sched, seqs, base, ends, grows, firsts, registers)
