"""Aborts read while a node's handler awaits a send (common/node/steps.py, the roles).

An offer accepted, then its request aborted while the Accept was on its way out (the send
awaited: a full queue to the gateway; the abort from another task, an orphan's expiry say):
the prefill node must not schedule it. It was added finished, scheduled with no blocks, and
the next step's lookup of its request failed the step loop: the node stopped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pdserve.common.engine.scheduler import SchedulerOutput
from pdserve.common.engine.sequence import SeqStatus, Sequence
from pdserve.common.node.role import NodeRequest
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Accept, DecodeTarget, PrefillOffer
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole

STEP = ([], 0.0, 0.0)  # a decode node's engine_step result: its tokens, when it began, ended


def _decode_metrics() -> SimpleNamespace:
    """What a decode node's after_step counts: tokens, and a local prompt's prefill."""
    count = SimpleNamespace(inc=lambda n=1: None, observe=lambda seconds: None)
    return SimpleNamespace(generation_tokens=count, local_prefills=count, queue_time=count,
                           prefill_time=count, prompt_tokens=count)  # fmt: skip


def test_a_request_aborted_while_its_accept_goes_out_is_never_scheduled():
    added: list[Any] = []
    sent: list[Any] = []

    async def send_gateway(msg: Any) -> None:
        sent.append(msg)
        if isinstance(msg, Accept):  # meanwhile the request is dropped (runtime.drop)
            req = node.requests.pop(msg.request_id)
            req.seq.status = SeqStatus.FINISHED

    node = SimpleNamespace(
        draining=False,
        requests={},
        scheduler=SimpleNamespace(can_take=lambda *a: None, add=added.append),
        metrics=SimpleNamespace(offer=lambda ok: None),
        send_gateway=send_gateway,
        steps=SimpleNamespace(wake=lambda: None),
        kv=SimpleNamespace(fetches=SimpleNamespace(fetching={}, start=lambda seq, offer: False)),
        engine_limits=lambda: (4096, 49152),
        engine=SimpleNamespace(block_size=16),
    )
    role = PrefillRole.__new__(PrefillRole)
    role.node = node  # type: ignore[assignment]
    role.queueing = False
    target = DecodeTarget(node_id="d", data_address="tcp://x:1", host_id="h")
    offer = PrefillOffer(request_id="r.0", prompt_ids=[1, 2, 3], params=SamplingParams(),
                         decode=target)  # fmt: skip
    asyncio.run(role._on_offer(offer))
    assert [type(m) for m in sent] == [Accept]
    assert added == [] and node.requests == {}


def test_a_sequence_aborted_during_after_step_s_sends_gets_no_token_sent():
    """A decode node's after_step awaits a FirstToken send for one sequence; an abort read
    meanwhile drops another of the same step: its token is not sent, its end not recorded
    again (the step loop promises it: common/node/steps.py)."""
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    local = Sequence.new("local.0", [1, 2, 3], params)
    local.token_ids.append(7)  # prefilled here: its first token goes as a FirstToken
    other = Sequence.new("other.0", [4, 5, 6], params)
    other.token_ids += [8, 9]
    pushed: list[Any] = []

    async def send_gateway(msg: Any) -> None:
        node.requests.pop("other.0")  # the abort, read while this send awaited

    async def push_step(batch: list[Any]) -> None:
        pushed.extend(batch)

    node = SimpleNamespace(
        requests={"local.0": NodeRequest(local), "other.0": NodeRequest(other)},
        draining=False,
        metrics=_decode_metrics(),
        engine=SimpleNamespace(eos_token_ids=(), max_model_len=4096),
        finished=lambda seq, reason: pushed.append(("finished", seq.seq_id)),
        send_gateway=send_gateway,
        push_step=push_step,
    )
    role = DecodeRole.__new__(DecodeRole)
    role.node = node  # type: ignore[assignment]
    role.to_park = {}
    asyncio.run(role.after_step(SchedulerOutput(), [local, other], STEP))
    assert pushed == []


def test_a_sequence_prefilled_here_during_a_drain_is_migrated_too():
    """A decode node's own prefill still waiting when its drain began could not be parked
    then (on_drain migrates what runs); it is parked once its first token is out, as the
    rest, instead of holding the drain until --drain-timeout and being recomputed."""
    seq = Sequence.new("local.0", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    seq.token_ids.append(7)
    parked: list[str] = []

    async def send_gateway(msg: Any) -> None:
        pass

    async def push_step(batch: list[Any]) -> None:
        pass

    node = SimpleNamespace(
        requests={"local.0": NodeRequest(seq)},
        draining=True,
        cfg=SimpleNamespace(drain_migrate="on"),
        metrics=_decode_metrics(),
        engine=SimpleNamespace(eos_token_ids=(), max_model_len=4096),
        finished=lambda seq, reason: None,
        send_gateway=send_gateway,
        push_step=push_step,
    )
    role = DecodeRole.__new__(DecodeRole)
    role.node = node  # type: ignore[assignment]
    role.to_park = {}
    role._park = lambda rid, why: parked.append(rid)  # type: ignore[method-assign]
    asyncio.run(role.after_step(SchedulerOutput(), [seq], STEP))
    assert parked == ["local.0"]
