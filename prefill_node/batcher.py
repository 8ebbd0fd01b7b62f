"""Which offers a prefill node accepts, and which accepted requests form the next batch. Pure.

On-demand mode (P/D-Serve): accept only while the running batch b (accepted and not yet
prefilled) is below `max_batch` (bp), the batch's prompt tokens stay within
`max_batch_tokens`, and the KV cache can hold the prompt; otherwise reject at once, never
queue. A prompt longer than the token budget is accepted only into an empty batch.
Queueing mode (the baselines of round-robin / JSQ / kv-aware routing) accepts every offer
that could ever fit and keeps a FIFO queue; batches are cut from its head by the same limits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.protocol import DecodeTarget
from pdserve.common.sampling import SamplingParams


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decode: DecodeTarget
    num_prompt_tokens: int
    accepted_at: float
    block_table: list[int] = field(default_factory=list)
    aborted: bool = False
    first_token: int | None = None  # sampled by the prefill, sent with KvDone

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


class PrefillBatcher:
    def __init__(
        self,
        max_batch: int,
        max_batch_tokens: int,
        block_size: int,
        num_blocks: int,
        queueing: bool,
    ) -> None:
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.queueing = queueing
        self.pending: deque[PrefillJob] = deque()
        self.running: list[PrefillJob] = []

    def blocks_for(self, job: PrefillJob) -> int:
        return -(-job.num_tokens // self.block_size)

    def offer(self, job: PrefillJob, free_blocks: int) -> str | None:
        """None to accept (the job is queued for the next batch), else the reason to reject."""
        if self.blocks_for(job) > self.num_blocks:
            return f"prompt of {job.num_tokens} tokens exceeds this node's KV cache"
        if not self.queueing:
            jobs = [*self.running, *self.pending]
            if len(jobs) >= self.max_batch:
                return f"batch full ({len(jobs)}/{self.max_batch})"
            tokens = sum(j.num_tokens for j in jobs)
            if jobs and tokens + job.num_tokens > self.max_batch_tokens:
                return f"token budget ({tokens} + {job.num_tokens} > {self.max_batch_tokens})"
            reserved = sum(self.blocks_for(j) for j in self.pending)
            if self.blocks_for(job) > free_blocks - reserved:
                return "KV cache full (transfers in flight)"
        self.pending.append(job)
        return None

    def next_batch(self, free_blocks: int) -> list[PrefillJob]:
        """Jobs to prefill now, from the head of the queue, within the limits and free KV."""
        batch: list[PrefillJob] = []
        tokens = blocks = 0
        while self.pending and len(batch) < self.max_batch:
            job = self.pending[0]
            if batch and tokens + job.num_tokens > self.max_batch_tokens:
                break
            if blocks + self.blocks_for(job) > free_blocks:
                break
            self.pending.popleft()
            batch.append(job)
            tokens += job.num_tokens
            blocks += self.blocks_for(job)
        self.running = batch
        return batch

    def batch_done(self) -> None:
        self.running = []

    def remove(self, request_id: str) -> PrefillJob | None:
        for job in self.pending:
            if job.request_id == request_id:
                self.pending.remove(job)
                return job
        return None
