"""Colocated generation: one engine, one scheduler, continuous batching, optional chunking.

This is the single-process reference the cluster must match token for token, the engine
behind `pdserve generate`, and the colocated baseline. Text and stop strings are handled
here by an output processor per request, as the gateway does in the cluster.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence, check_stop
from pdserve.common.engine.step_work import step_work
from pdserve.common.model.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from pdserve.common.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None


class _OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids)
        self.stops = StopStringMatcher(list(seq.params.stop))
        self.stop_token_ids = seq.params.stop_token_ids
        self.output = RequestOutput(seq.seq_id, list(seq.token_ids))

    def add(self, token: int, finish_reason: str | None) -> RequestOutput:
        out = self.output
        out.token_ids.append(token)
        out.new_token_ids = [token]
        # a stop token's own text is not output (vLLM's rule), as at the cluster's gateway
        stop_token = finish_reason == "stop" and token in self.stop_token_ids
        out.new_text = self.stops.feed("" if stop_token else self.detok.add(token))
        if self.stops.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            out.new_text += self.stops.flush()
        out.text += out.new_text
        out.finished, out.finish_reason = finish_reason is not None, finish_reason
        return out


def make_engine(cfg: EngineConfig, eos_token_ids: tuple[int, ...] | None = None) -> Engine:
    if cfg.engine == "sim":
        from pdserve.common.engine.sim import SimEngine

        return SimEngine(cfg)
    from pdserve.common.engine.runner import ModelRunner

    return ModelRunner(cfg, eos_token_ids)


class LLMEngine:
    def __init__(
        self, cfg: EngineConfig, engine: Engine | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer or Tokenizer.load(cfg.model)
        self.engine = engine or make_engine(cfg, self.tokenizer.eos_token_ids)
        eng = self.engine
        self.scheduler = Scheduler(
            SchedulerConfig.of(
                cfg, eng.num_blocks, eng.block_size, "colocated", getattr(eng, "model_id", "")
            )
        )
        eng.max_model_len = self.scheduler.fit(eng.max_model_len)
        self.processors: dict[str, _OutputProcessor] = {}
        self.seqs: dict[str, Sequence] = {}

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id} is already running")
        if len(prompt_ids) >= self.engine.max_model_len:
            limit = self.engine.max_model_len
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit is {limit}")
        if not params.greedy and params.seed is None:
            params = params.with_seed(secrets.randbits(63))
        seq = Sequence.new(request_id, prompt_ids, params)
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        self.processors[request_id] = _OutputProcessor(self.tokenizer, seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self.processors.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        tokens = self.engine.step(*step_work(sched))
        outputs = []
        for seq in self.scheduler.on_step_done(sched, tokens):
            reason = check_stop(seq, self.engine.eos_token_ids, self.engine.max_model_len)
            out = self.processors[seq.seq_id].add(seq.token_ids[-1], reason)
            if out.finished:
                self.scheduler.finish(seq, out.finish_reason or "stop")
                del self.seqs[seq.seq_id], self.processors[seq.seq_id]
            outputs.append(out)
        return outputs

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion (all in flight together) and return their outputs."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{secrets.token_hex(4)}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        while self.has_work:
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
