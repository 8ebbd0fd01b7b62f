"""Engine-side request state, in vLLM's vocabulary. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.common.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill node: done here, KV kept until handed off
    PREEMPTED = "preempted"  # decode node: given back to be re-placed
    FINISHED = "finished"


# compared by identity, one request each: `seq in scheduler.waiting` compares no fields (a
# value match built every field's tuple), and two alike (one id sent twice) are two
@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # prefix caching: chained hashes of its full blocks so far (extended, never recomputed),
    # how many of its blocks are registered in the cache, and its prompt tokens that were
    # found cached at admission
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    overtaken: int = 0  # prefill, shortest first: tokens of later prompts run before it

    @classmethod
    def new(cls, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        return cls(seq_id, list(prompt_ids), len(prompt_ids), params)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still has tokens (prompt, or prompt + outputs after preemption) without KV."""
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_output_tokens == 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


def check_stop(seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int) -> str | None:
    """Finish reason after the newest token was appended, or None to go on.

    Stop strings are not checked here: they need text, and the detokenizer that owns the text
    (the colocated engine's output processor, or the gateway in the cluster) checks them.
    """
    last = seq.token_ids[-1]
    params = seq.params
    if not params.ignore_eos and last in eos_token_ids:
        return "stop"
    if last in params.stop_token_ids:
        return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
