"""The role interface: what the prefill, decode and colocated roles plug into a node's
runtime (common/node/runtime.py), and the request-table entry they share with it. A role
answers the gateway's messages, shapes the steps (before, in the engine thread, after) and,
on nodes with a KV data plane, takes and hands off request KV. Each part of the node sees
only its slice: `RoleMessages` and `NodeState` (control.py; both here), `StepHooks`
(steps.py), `KvHooks` (kv.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.common.engine.scheduler import Mode, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.kv.base import Intake, Transfer
from pdserve.common.node.fairness import Room
from pdserve.common.wire.kv_messages import (
    KvHeader,
)
from pdserve.common.wire.protocol import (
    DecodeTarget,
    Foreign,
    Load,
    NodeInfo,
    RegisterAck,
)


@dataclass
class NodeRequest:
    """A request the node holds: its engine `Sequence` plus what the role needs beside it."""

    seq: Sequence
    accepted_at: float = field(default_factory=time.monotonic)
    target: DecodeTarget | None = None  # prefill: the decode node its KV goes to
    skip: int = 0  # prefill: leading tokens whose KV that node holds (not sent)
    prompt_len: int = 0  # the client's prompt within seq's prompt (0: all of it): Adopted
    stream_format: bytes = b""  # the gateway's, not read here: Adopted
    began: float = 0.0  # decode: when the first step of its own prefill began (--local-prefill)


class Role(Protocol):
    """Built once per node as `role(runtime)`; common/node/defaults.py says what a role that
    does not care about a hook does."""

    role: str  # "prefill", "decode", "colocated": what the gateway registers
    mode: Mode  # the engine scheduler's mode
    pushes_tokens: bool  # decode and colocated nodes stream tokens to the gateway
    has_data_plane: bool  # KV arrives or leaves over the KV connectors

    def __init__(self, node: Any) -> None: ...
    @staticmethod
    def scheduler_config(base: SchedulerConfig) -> SchedulerConfig:
        """The node's scheduler settings, shaped for the role."""

    # -- the gateway -----------------------------------------------------------------------
    def on_registered(self, ack: RegisterAck) -> None:
        """The gateway accepted us and said how to take work."""

    async def on_gateway_message(self, msg: Any) -> None:
        """Any gateway message but the control plane's own (registration, heartbeats)."""

    def on_drain(self) -> None:
        """The node begins to drain (a signal, `Drain`, a role switch)."""

    async def on_drain_timeout(self) -> None:
        """Hand back whatever is still held when the drain timeout passes."""

    def on_adopted(self, rid: str) -> None:
        """A running orphan was adopted: it has a gateway to ask where it goes again."""

    # -- steps -----------------------------------------------------------------------------
    async def before_step(self, out: SchedulerOutput) -> None:
        """The step is scheduled and about to run."""

    def engine_step(self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop) -> Any:
        """Engine thread: run the step; returns the sampled tokens (or what after_step needs)."""

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        """The step is done; `grew` are the sequences that produced a token (aborted ones
        left out)."""

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        """Sequences the scheduler preempted (decode: handed back to the gateway)."""

    async def step_failed(self, out: SchedulerOutput, exc: Exception) -> None:
        """The engine raised (by default the node stops: a supervisor restarts it)."""

    # -- requests and their KV -------------------------------------------------------------
    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        """A request was aborted: let go of what the role holds for it beside the engine."""

    def extra_held(self) -> list[str]:
        """Ids the role holds outside the request table (a decode node's incoming KV)."""

    def promised_blocks(self) -> int:
        """KV blocks accepted work will take that are not allocated yet (a decode node's
        waiting local prompts): reported as in use."""

    def room(self) -> Room | None:
        """What an offer may take now (prefill on demand); None: no such limit."""

    def reserve_kv(self, h: KvHeader) -> list[int] | str:
        """A request's KV is announced (decode): the blocks it lands in, or why not."""

    async def admit_kv(self, intake: Intake, first_token: int) -> None:
        """A request's KV has landed (decode)."""

    def kv_acked(self, t: Transfer) -> None:
        """A request's KV we sent was acknowledged (prefill, a migrating decode node)."""

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        """A request's KV we sent was refused."""


class NodeState(Protocol):
    """What the control plane reports of the node and asks of it."""

    def info(self) -> NodeInfo: ...
    def load(self) -> Load: ...
    def idle(self) -> bool: ...  # nothing held: a draining node may exit
    def hung(self) -> str | None: ...  # why the engine counts as hung (--step-timeout)
    def free_stale(self, request_ids: tuple[str, ...]) -> None: ...
    def abort(self, rid: str) -> None: ...
    def foreign(self, request_ids: list[str]) -> Foreign: ...  # what these ids hold
    def holds(self, rid: str) -> bool: ...
    def unpark(self, rid: str) -> None: ...  # parked to move: decodes here again
    def adopted(self, rid: str) -> None: ...  # a running orphan has a gateway again
    @property
    def requests(self) -> dict[str, NodeRequest]: ...


class RoleMessages(Protocol):
    """The role's part: the gateway's other messages, and what a drain leaves behind."""

    role: str
    pushes_tokens: bool  # decode and colocated nodes stream tokens to the gateway

    def on_registered(self, ack: RegisterAck) -> None: ...
    async def on_gateway_message(self, msg: Any) -> None: ...
    async def on_drain_timeout(self) -> None: ...
    def on_drain(self) -> None: ...
    def room(self) -> Room | None: ...  # what an offer may take now (None: no such limit)
