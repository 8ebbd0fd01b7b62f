"""One batch ahead on a real prefill node (sim engine, real sockets): a prompt offered while a
pass runs is accepted into the next pass and waits at most the rest of the running one;
beyond one batch ahead, offers are still refused (--prefill-ahead, common/engine/scheduler.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdserve.common.wire.protocol import Accept, FirstToken, Reject
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import until
from tests.component.test_gateways import ScriptedGateway, _node, _stop

# The step loop's turnaround between two passes (after_step of one, schedule of the next) on
# a 2-core machine that also runs the decode node, the scripted gateway and pytest: a few ms
# measured; 0.25 s leaves room for a loaded CI host without admitting a second pass (>0.5 s).
TURNAROUND_S = 0.25
SCALE = 8.0  # modelled H100 time x 8: the 2,000-token pass ~0.51 s, a 32-token one ~0.07 s


class _Lag:
    """When this event loop (every node and the gateway of the test) was not run as a 5 ms
    ticker fell due: the host's other processes holding both cores (a loaded CI host: 0.6 s
    seen in a wait), time the node's turnaround is not answerable for. An idle wait in the
    node (a timer, a poll, a pass more) is not in it: the loop is free to tick then."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []  # (when, how late)
        self.task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.005
            await asyncio.sleep(0.005)
            self.ticks.append((loop.time(), max(0.0, loop.time() - due - 0.005)))

    def within(self, start: float, end: float) -> float:
        """How long the loop was late between `start` and `end` (loop time)."""
        return sum(max(0.0, min(at, end) - max(at - late, start)) for at, late in self.ticks)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _first(gw: ScriptedGateway, rid: str) -> FirstToken | None:
    return next((m for m in gw.inbox if isinstance(m, FirstToken) and m.request_id == rid), None)


@pytest.mark.parametrize("ahead", ["off", "on"])
async def test_a_prompt_offered_mid_pass_waits_at_most_the_rest_of_it(tokenizer, ahead) -> None:
    gw = ScriptedGateway("gw")
    prefill, decode = None, None
    lag: _Lag | None = None
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [gw], max_batch=1,
                              sim_time_scale=SCALE, prefill_ahead=ahead)  # fmt: skip
        decode = await _node(tokenizer, DecodeRole, "decode-0", [gw], sim_time_scale=SCALE)
        p, d = prefill[0], decode[0]
        await gw.offer(p, "long", d, 2, tokens=2000)
        await until(lambda: "long" in p.steps.in_step, what="the long pass running")
        lag = _Lag()
        offered = asyncio.get_running_loop().time()  # at most its acceptance
        await gw.offer(p, "short", d, 2, tokens=32)
        await until(lambda: gw.answers("short"), what="an answer")
        answer = gw.answers("short")[0]
        if ahead == "off":  # the running pass fills the batch
            assert isinstance(answer, Reject) and "batch full" in answer.reason
            return
        assert isinstance(answer, Accept)
        assert "long" in p.steps.in_step  # it was accepted while the pass ran
        # one batch ahead and no more: the next pass (max_batch 1) is taken
        await gw.offer(p, "third", d, 2, tokens=32)
        await until(lambda: gw.answers("third"), what="an answer")
        third = gw.answers("third")[0]
        assert isinstance(third, Reject) and "batch full" in third.reason
        await until(lambda: _first(gw, "short") is not None, what="the short prompt's token")
        long, short = _first(gw, "long"), _first(gw, "short")
        assert long is not None and short is not None
        # its wait ran from its acceptance, during the long pass, to the next pass
        late = lag.within(offered, offered + short.queue_ms / 1000)
        assert short.queue_ms <= long.prefill_ms + (TURNAROUND_S + late) * 1000, (short, long, late)
        assert short.prefill_ms < long.prefill_ms  # its own pass, alone, after the long one
    finally:
        if lag is not None:
            await lag.close()
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await gw.close()
