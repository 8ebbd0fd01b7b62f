"""A resend begun while a pass's after_step waits (a decode node refused a request's KV mid-pass,
then a Redirect came, or its prefix was gone) is a transfer of its own: the pass's KV and
KvDone are not its. Before, after_step found the new transfer under the request's id and
pushed the old pass's layers (and a KvDone) into it, and the resend pushed its own: every
layer twice, or a KvDone ahead of every layer (a layer-wise pass)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pdserve.common.engine.scheduler import SchedulerOutput
from pdserve.common.engine.sequence import Sequence
from pdserve.common.node.role import NodeRequest
from pdserve.common.sampling import SamplingParams
from pdserve.prefill_node.layerwise import BatchTails, LayerwiseRule
from pdserve.prefill_node.server import PrefillRole


def test_a_resend_begun_during_after_step_gets_none_of_the_pass_s_kv():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seqs = {rid: Sequence.new(rid, [5, 6, 7], params) for rid in ("a.0", "b.0")}
    for seq in seqs.values():
        seq.token_ids.append(9)  # the pass's first token
    old = {rid: SimpleNamespace(request_id=rid, layerwise=False, prefill_end=0.0, total_bytes=64)
           for rid in seqs}  # fmt: skip
    resend = SimpleNamespace(request_id="b.0", layerwise=False, prefill_end=0.0, total_bytes=64)
    sent: list[tuple[str, Any]] = []
    transfers = dict(old)

    async def send_gateway(msg: Any) -> None:
        if msg.request_id == "a.0":  # meanwhile b's resend begins (send_kv)
            transfers["b.0"] = resend

    sender = SimpleNamespace(
        transfers=transfers,
        push_all=lambda t, payloads: sent.append(("push", t)),
        done=lambda t, token: sent.append(("done", t)),
        abort=lambda rid: None,
    )
    count = SimpleNamespace(observe=lambda v: None, inc=lambda v: None)
    node = SimpleNamespace(
        requests={rid: NodeRequest(seq=s) for rid, s in seqs.items()}, sender=sender,
        metrics=SimpleNamespace(queue_time=count, prefill_time=count, prompt_tokens=count),
        engine=SimpleNamespace(eos_token_ids=(), max_model_len=4096),
        send_gateway=send_gateway,
    )  # fmt: skip
    role = PrefillRole.__new__(PrefillRole)
    role.node = node
    role.layerwise = SimpleNamespace(observe_pass=lambda *a: None)
    role.tails = BatchTails(LayerwiseRule())
    out = SchedulerOutput(prefills=[(s, 3) for s in seqs.values()])
    result = ([9, 9], {"a.0": ["kv-a"], "b.0": ["kv-b"]}, 0.0, 0.1, dict(old))
    asyncio.run(role.after_step(out, list(seqs.values()), result))
    # a's pass KV and KvDone; b's resend sends its own, whole: none of this pass's into it
    assert sent == [("push", old["a.0"]), ("done", old["a.0"])]
    assert not any(t is resend for _, t in sent) and resend.prefill_end == 0.0


def _tail_pass(n: int, send_gateway: Any) -> tuple[PrefillRole, list[Sequence], dict, Any]:
    """A prefill role around a fake node after one pass of `n` requests, each with a
    transfer of 1,000 bytes sent at the end; its tail tracker real. (role, seqs, transfers,
    the pass's result for after_step)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seqs = [Sequence.new(f"r{k}.0", [5, 6, 7], params) for k in range(n)]
    for seq in seqs:
        seq.token_ids.append(9)
    transfers = {s.seq_id: SimpleNamespace(request_id=s.seq_id, layerwise=False,
                                           prefill_end=0.0, total_bytes=1000, finished=0.0)
                 for s in seqs}  # fmt: skip
    count = SimpleNamespace(observe=lambda v: None, inc=lambda v: None)
    role = PrefillRole.__new__(PrefillRole)
    role.node = SimpleNamespace(
        requests={s.seq_id: NodeRequest(seq=s) for s in seqs},
        sender=SimpleNamespace(transfers=transfers, push_all=lambda t, p: None,
                               done=lambda t, token: None, abort=lambda rid: None),
        metrics=SimpleNamespace(queue_time=count, prefill_time=count, prompt_tokens=count),
        engine=SimpleNamespace(eos_token_ids=(), max_model_len=4096),
        send_gateway=send_gateway,
    )  # fmt: skip
    role.layerwise = LayerwiseRule()
    role.tails = BatchTails(role.layerwise)
    role.handoff = SimpleNamespace(acked=lambda t: None)
    result = ([9] * n, {s.seq_id: ["kv"] for s in seqs}, 0.0, 10.0, dict(transfers))
    return role, seqs, transfers, result


def test_a_pass_s_transfers_give_one_tail_sample_once_all_are_acknowledged():
    # the node's hooks feed the batch tracker: three transfers of one pass, acknowledged
    # 1, 2 and 3 s after it (at the end, each waits for the ones ahead on the link)
    async def send_gateway(msg: Any) -> None:
        pass

    role, seqs, transfers, result = _tail_pass(3, send_gateway)
    rule = role.layerwise
    asyncio.run(role.after_step(SchedulerOutput(prefills=[(s, 3) for s in seqs]), seqs, result))
    for k, t in enumerate(transfers.values()):
        assert t.prefill_end == 10.0 and rule.tail[False].count == 0
        t.finished = 11.0 + k
        role.kv_acked(t)
    assert rule.tail[False].count == 1 and rule.tail[False].value == 3.0 / 3000


def test_a_transfer_dropped_while_the_pass_s_first_tokens_go_out_leaves_no_tail_entry():
    """Dropped (an Abort, a lease) while its own FirstToken went out: its tail entry was
    added after that await, and stayed (a batch that never samples, an entry kept until the
    tracker's cap threw away the in-flight batches' too)."""

    async def send_gateway(msg: Any) -> None:
        if msg.request_id == "r0.0":  # let go meanwhile, as node.drop does
            role.node.requests.pop("r0.0")
            role.on_dropped("r0.0", None)

    role, seqs, transfers, result = _tail_pass(2, send_gateway)
    asyncio.run(role.after_step(SchedulerOutput(prefills=[(s, 3) for s in seqs]), seqs, result))
    assert "r0.0" not in role.tails.of
    transfers["r1.0"].finished = 11.0
    role.kv_acked(transfers["r1.0"])
    assert not role.tails.of and role.layerwise.tail[False].count == 0  # lost one: no sample
