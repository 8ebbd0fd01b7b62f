"""What a role that does not care about a hook of the role interface (role.py) does: roles
take these defaults and override the hooks they need."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.common.engine.scheduler import Mode, SchedulerConfig, SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.step_work import step_work
from pdserve.common.kv.base import Intake, Transfer
from pdserve.common.node.fairness import Room
from pdserve.common.node.role import NodeRequest
from pdserve.common.node.runtime import NodeRuntime
from pdserve.common.wire.kv_messages import (
    KvHeader,
)
from pdserve.common.wire.protocol import (
    RegisterAck,
)


class RoleDefaults:
    role: str = "colocated"
    mode: Mode = "colocated"
    pushes_tokens: bool = False
    has_data_plane: bool = False

    def __init__(self, node: NodeRuntime) -> None:
        self.node = node

    @staticmethod
    def scheduler_config(base: SchedulerConfig) -> SchedulerConfig:
        return base

    def on_registered(self, ack: RegisterAck) -> None:
        pass

    async def on_gateway_message(self, msg: Any) -> None:
        raise NotImplementedError

    def on_drain(self) -> None:
        pass

    def on_adopted(self, rid: str) -> None:
        """A running orphan was adopted (its gateway is new: it can answer a move now)."""

    async def on_drain_timeout(self) -> None:
        pass

    async def before_step(self, out: SchedulerOutput) -> None:
        pass

    def engine_step(self, out: SchedulerOutput, loop: asyncio.AbstractEventLoop) -> Any:
        return self.node.engine.step(*step_work(out))

    async def after_step(self, out: SchedulerOutput, grew: list[Sequence], result: Any) -> None:
        pass

    async def on_preempted(self, seqs: list[Sequence]) -> None:
        pass

    async def step_failed(self, out: SchedulerOutput, exc: Exception) -> None:
        raise exc

    def on_dropped(self, rid: str, req: NodeRequest | None) -> None:
        pass

    def extra_held(self) -> list[str]:
        return []

    def promised_blocks(self) -> int:
        return 0

    def room(self) -> Room | None:
        return None  # takes whatever could ever fit (queueing), or offers are not its work

    def reserve_kv(self, h: KvHeader) -> list[int] | str:
        return f"a {self.role} node takes no request KV"

    async def admit_kv(self, intake: Intake, first_token: int) -> None:
        pass

    def kv_acked(self, t: Transfer) -> None:
        pass

    async def kv_refused(self, rid: str, peer: str, why: str) -> None:
        pass
