"""The gateway's liveness tick (gateway/liveness.py) on a KV hand-off that never completes:
both nodes go on with their other work, so no node's progress lease fires, and the request
would wait forever after its first token with its blocks held on both nodes."""

from __future__ import annotations

import asyncio

from pdserve.common.config import GatewayConfig
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.liveness import Liveness
from pdserve.gateway.prefix_index import PrefixIndex
from pdserve.gateway.table import Attempt, RequestTable
from tests.conftest import gateway_request


class _Service:
    """What the tick asks of the request service: re-placements, spawned."""

    def __init__(self) -> None:
        self.replaced: list[tuple[str, str]] = []

    def spawn(self, coro) -> None:
        asyncio.get_running_loop().create_task(coro)

    async def replace(self, attempt: Attempt, reason: str, kind: str = "lost") -> None:
        self.replaced.append((attempt.wire_id, reason))


class _Pools:
    async def tick(self, now: float, awake: float) -> None:
        pass


async def test_a_kv_hand_off_stalled_past_the_progress_timeout_is_placed_again():
    cfg = GatewayConfig(progress_timeout=5.0)
    table, service = RequestTable(), _Service()
    liveness = Liveness(cfg, ClusterView(cfg.heartbeat_timeout), table, PrefixIndex(),
                        None, service, _Pools())  # type: ignore[arg-type]  # fmt: skip
    stuck, fine = table.open(gateway_request("s"), 32), table.open(gateway_request("f"), 32)
    for attempt in (stuck, fine):
        table.commit(attempt, "p0", "d0", blocks=2, now=100.0)
        table.prefilled(attempt, 101.0)
    table.delivered(fine, 101.5)
    await liveness._tick(105.0, 0.0, 0.25)
    await asyncio.sleep(0)
    assert service.replaced == []  # within the timeout
    await liveness._tick(106.5, 1.5, 0.25)  # the gateway itself stalled 1.5 s
    await asyncio.sleep(0)
    assert service.replaced == []  # the KvTransferred may wait unread: judged from now on
    await liveness._tick(110.0, 0.0, 0.25)
    await asyncio.sleep(0)
    assert service.replaced == []  # 3.5 s since the stall ended
    await liveness._tick(112.0, 0.0, 0.25)
    await asyncio.sleep(0)
    assert service.replaced == [("s.0", "its KV did not reach d0 in 5 s")]
