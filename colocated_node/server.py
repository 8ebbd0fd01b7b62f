"""Colocated node: the baseline disaggregation must beat, behind the same gateway and API.

One LLMEngine (continuous batching, chunked prefill with `--chunk-size`) runs both phases:
a long prompt joining the batch delays every decoding stream in it, which is exactly the
interference disaggregation removes. It accepts every offer (the engine's scheduler queues,
as vLLM does), reports the first token of each request to the gateway (`FirstToken`, for the
same TTFT accounting) and later tokens as one `TokenBatch` per engine step. Aborts that
arrive while a step runs are applied right after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.engine.interface import Engine
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.node import NodeBase
from pdserve.common.protocol import (
    Abort,
    Accept,
    Drain,
    FirstToken,
    Load,
    Preempted,
    PrefillOffer,
    Reject,
    TokenBatch,
)
from pdserve.common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ColocatedNode(NodeBase):
    role = "colocated"
    pushes_tokens = True

    def __init__(
        self, cfg: NodeConfig, ecfg: EngineConfig, engine: Engine, tokenizer: Tokenizer
    ) -> None:
        super().__init__(cfg, ecfg, engine, tokenizer)
        self.llm = LLMEngine(ecfg, engine=engine, tokenizer=tokenizer)
        self.blocks = self.llm.scheduler.block_manager
        self.started: set[str] = set()  # requests whose first token went out
        self.pending_aborts: set[str] = set()
        self.stepping = False
        self.work = asyncio.Event()

    def data_address(self) -> str:
        return ""

    def load(self) -> Load:
        sched = self.llm.scheduler
        cached = self.blocks.num_cached_blocks
        return Load(
            running=len(sched.running),
            waiting=len(sched.waiting),
            blocks_free=self.blocks.num_free_blocks - cached,
            blocks_cached=cached,
            blocks_in_use=self.blocks.num_in_use_blocks,
            held=tuple(self.llm.seqs),
            draining=self.draining,
        )

    def idle(self) -> bool:
        return not self.llm.has_work

    async def serve(self) -> None:
        self.tasks.append(asyncio.create_task(self._engine_loop()))
        await super().serve()

    async def on_gateway_message(self, msg: Any) -> None:
        match msg:
            case PrefillOffer():
                await self._on_offer(msg)
            case Abort(request_id=rid):
                self._abort(rid)
            case Drain():
                self.begin_drain()
            case _:
                log.warning("unexpected gateway message %s", type(msg).__name__)

    async def _on_offer(self, offer: PrefillOffer) -> None:
        rid = offer.request_id
        if self.draining:
            await self.send_gateway(Reject(request_id=rid, reason="draining"))
            return
        try:
            self.llm.add_request(rid, offer.prompt_ids, offer.params)
        except ValueError as exc:
            self.metrics.offer(False)
            await self.send_gateway(Reject(request_id=rid, reason=str(exc)))
            return
        self.metrics.offer(True)
        self.metrics.prompt_tokens.inc(len(offer.prompt_ids))
        await self.send_gateway(Accept(request_id=rid))
        self.work.set()

    def _abort(self, rid: str) -> None:
        if self.stepping:
            self.pending_aborts.add(rid)  # the running step uses its blocks
        else:
            self.llm.abort(rid)
            self.started.discard(rid)

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            self._abort(rid)

    async def on_drain_timeout(self) -> None:
        for rid in list(self.llm.seqs):
            msg = Preempted(node_id=self.node_id, request_id=rid, reason="draining")
            await self.push_tokens(msg)
            self._abort(rid)

    async def _engine_loop(self) -> None:
        while True:
            await self.work.wait()
            self.work.clear()
            while self.llm.has_work:
                for rid in self.pending_aborts:
                    self.llm.abort(rid)
                    self.started.discard(rid)
                self.pending_aborts.clear()
                self.stepping = True
                started = time.monotonic()
                try:
                    outputs = await self.run_engine(self.llm.step)
                finally:
                    self.stepping = False
                self.metrics.step_time.observe(time.monotonic() - started)
                self.metrics.generation_tokens.inc(len(outputs))
                ids, tokens, indices, reasons = [], [], [], []
                for out in outputs:
                    rid, token = out.request_id, out.new_token_ids[-1]
                    if rid in self.pending_aborts:
                        continue
                    if rid not in self.started:
                        self.started.add(rid)
                        await self.send_gateway(
                            FirstToken(
                                request_id=rid, token_id=token, finish_reason=out.finish_reason
                            )
                        )
                    else:
                        ids.append(rid)
                        tokens.append(token)
                        indices.append(len(out.token_ids) - 1)
                        reasons.append(out.finish_reason)
                    if out.finished:
                        self.started.discard(rid)
                if ids:
                    await self.push_tokens(
                        TokenBatch(
                            node_id=self.node_id,
                            request_ids=ids,
                            token_ids=tokens,
                            indices=indices,
                            finish_reasons=reasons,
                        )
                    )
