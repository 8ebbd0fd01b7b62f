"""Nodes serving several gateways, against two scripted gateways on real ZeroMQ sockets: the
nodes arbitrate their own room (two gateways' offers for the last slot get one Accept and one
Reject), and a request belongs to the gateway that placed it (its tokens go there alone; no
other gateway can abort it; a KV header naming a gateway the decode node does not serve is
refused)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdserve.common.config import NodeConfig
from pdserve.common.engine.sim import SimEngine
from pdserve.common.node import NodeRuntime
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import (
    NODE_DECODER,
    TOKENS_DECODER,
    Abort,
    Accept,
    Adopt,
    Adopted,
    DecodeTarget,
    FirstToken,
    GatewayLoad,
    Heartbeat,
    HeartbeatReply,
    Load,
    NeedDecode,
    PrefillOffer,
    Register,
    RegisterAck,
    RegisterRefuse,
    Reject,
    SwitchRole,
    TokenBatch,
)
from pdserve.common.wire.security import close_context, make_context
from pdserve.common.wire.transport import free_port, make_socket, send
from pdserve.decode_node.server import DecodeRole
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import SIM, prompt, until

pytestmark = pytest.mark.asyncio


class ScriptedGateway:
    """A gateway's two sockets: it acknowledges registrations and heartbeats (recording the
    loads), and keeps every other message and every token it receives."""

    def __init__(self, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self.ctx = make_context(None)
        self.control_address = f"tcp://127.0.0.1:{free_port()}"
        self.control = make_socket(self.ctx, "gateway.control", self.control_address)
        tokens_port = free_port()
        self.tokens = make_socket(self.ctx, "gateway.tokens", f"tcp://127.0.0.1:{tokens_port}")
        self.tokens_address = f"tcp://127.0.0.1:{tokens_port}"
        self.nodes: dict[str, bytes] = {}  # node id -> control identity
        self.heartbeats: dict[str, Heartbeat] = {}
        self.beats: list[Heartbeat] = []
        self.asked_only = False  # answer only the heartbeats that ask (Heartbeat.reply)
        self.queueing = False  # a baseline policy's gateway (said at registration)
        self.inbox: list[object] = []
        self.streamed: dict[str, list[int]] = defaultdict(list)  # rid -> output indices
        self.on_first: Any = None  # awaited on a FirstToken, before the next message is read
        self.muted = False  # answers nothing (a gateway that died without closing anything)
        self.said: GatewayLoad | None = None  # its load, in its heartbeat replies
        self.forgets = False  # a node it has not registered is told "unknown node" (`restart`)
        self.refuses: dict[str, str] = {}  # node id -> why its Register is refused
        self.refused: list[str] = []
        self.tasks = [asyncio.create_task(self._control()), asyncio.create_task(self._tokens())]

    async def _control(self) -> None:
        while True:
            identity, payload = await self.control.recv_multipart()
            msg = NODE_DECODER.decode(payload)
            if isinstance(msg, Heartbeat):
                self.beats.append(msg)  # every one, a muted gateway's too
            if self.muted:
                continue
            if isinstance(msg, Register) and msg.info.node_id in self.refuses:
                why = self.refuses[msg.info.node_id]
                no = RegisterRefuse(node_id=msg.info.node_id, reason=why)
                await send(self.control, no, to=identity)
                self.refused.append(msg.info.node_id)
            elif isinstance(msg, Register):
                self.nodes[msg.info.node_id] = identity
                ack = RegisterAck(node_id=msg.info.node_id, tokens_address=self.tokens_address,
                                  gateway_id=self.gateway_id, queueing=self.queueing)  # fmt: skip
                await send(self.control, ack, to=identity)
            elif isinstance(msg, Heartbeat):
                self.heartbeats[msg.node_id] = msg
                if self.forgets and msg.node_id not in self.nodes:
                    await send(self.control, HeartbeatReply(unknown_node=True), to=identity)
                elif msg.reply or not self.asked_only:
                    await send(self.control, HeartbeatReply(load=self.said), to=identity)
            else:
                self.inbox.append(msg)
                if isinstance(msg, FirstToken):
                    self.streamed[msg.request_id].append(msg.index)
                    if self.on_first is not None:
                        await self.on_first(msg)

    async def _tokens(self) -> None:
        while True:
            msg = TOKENS_DECODER.decode(await self.tokens.recv())
            if isinstance(msg, TokenBatch):
                for rid, index in zip(msg.request_ids, msg.indices, strict=True):
                    self.streamed[rid].append(index)

    async def offer(
        self,
        node: NodeRuntime,
        rid: str,
        decode: NodeRuntime,
        n: int,
        tokens: int = 32,
        waited_ms: float = 0.0,
        foreign_prefill: int = -1,
    ) -> None:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        offer = PrefillOffer(request_id=rid, prompt_ids=prompt(tokens), params=params,
                             decode=_target(decode), waited_ms=waited_ms,
                             foreign_prefill=foreign_prefill)  # fmt: skip
        await send(self.control, offer, to=self.nodes[node.node_id])

    def restart(self, gateway_id: str) -> None:
        """A new process on the same address, at once: its nodes and requests forgotten."""
        self.gateway_id, self.forgets = gateway_id, True
        self.nodes.clear()

    async def tell(self, node: NodeRuntime, msg: object) -> None:
        await send(self.control, msg, to=self.nodes[node.node_id])  # type: ignore[arg-type]

    def answers(self, rid: str) -> list[object]:
        return [m for m in self.inbox if isinstance(m, Accept | Reject) and m.request_id == rid]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.control.close()
        self.tokens.close()
        close_context(self.ctx)


def _beat(gateway: ScriptedGateway, node_id: str) -> Any:
    """The last heartbeat `gateway` got from `node_id`; before any, one whose checks fail."""
    empty = Heartbeat(node_id=node_id, load=Load(running=0, waiting=0, blocks_free=0,
                                                 blocks_cached=0, blocks_in_use=0))  # fmt: skip
    return gateway.heartbeats.get(node_id, empty)


def _target(node: NodeRuntime) -> DecodeTarget:
    info = node.info()
    return DecodeTarget(node_id=info.node_id, data_address=info.data_address,
                        host_id=info.host_id, kv_endpoints=info.kv_endpoints)  # fmt: skip


async def _node(tokenizer, role, node_id: str, gateways: list[ScriptedGateway], node_cfg=None,
                **ecfg):  # fmt: skip
    node_cfg = {"heartbeat_interval": 0.05, **(node_cfg or {})}
    cfg = NodeConfig(gateway=",".join(g.control_address for g in gateways), node_id=node_id,
                     kv_backend="tcp", **node_cfg)  # fmt: skip
    engine_cfg = dataclasses.replace(SIM, **ecfg)
    node = NodeRuntime(role, cfg, engine_cfg, SimEngine(engine_cfg), tokenizer)
    task = asyncio.create_task(node.serve())
    await until(lambda: all(node_id in g.nodes for g in gateways), what="registrations")
    await until(lambda: all(link.registered for link in node.control.links), what="acks")
    return node, task


async def _stop(*pairs) -> None:
    for node, task in pairs:
        node.stopped.set()
        await asyncio.wait_for(task, 10)


async def test_a_node_relays_each_gateway_s_load_to_the_others(tokenizer):
    """The gateway leading pool care sizes the pools for every gateway's load: each tells
    the nodes its own in its heartbeat replies, and a node passes it on to the others."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    a.said = GatewayLoad(gateway="gw-a", prompt_tokens=4000, requests=1, waiting_tokens=123)
    node = None
    try:
        node = await _node(tokenizer, PrefillRole, "prefill-0", [a, b])
        await until(lambda: _beat(b, "prefill-0").load.gateways == (a.said,), what="relayed")
        assert _beat(a, "prefill-0").load.gateways == ()  # not told its own, nor b's (none)
        a.muted = True  # a gateway gone silent: its last word is relayed no more
        await until(lambda: node[0].control.links[0].silent_since is not None, 10, "silent")
        await until(lambda: _beat(b, "prefill-0").load.gateways == (), 5, "not relayed")
    finally:
        if node is not None:
            await _stop(node)
        await a.close()
        await b.close()


async def test_the_last_slot_goes_to_one_gateway_and_the_request_stays_its(tokenizer):
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    prefill, decode = None, None
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [a, b], max_batch=1,
                              sim_time_scale=0.5)  # fmt: skip
        decode = await _node(tokenizer, DecodeRole, "decode-0", [a, b], sim_time_scale=0.5)
        p, d = prefill[0], decode[0]
        # both gateways offer the prefill node's one batch slot at the same moment
        await asyncio.gather(a.offer(p, "ra.0", d, 60), b.offer(p, "rb.0", d, 60))
        await until(lambda: a.answers("ra.0") and b.answers("rb.0"), what="both answers")
        answers = [*a.answers("ra.0"), *b.answers("rb.0")]
        assert sorted(type(m).__name__ for m in answers) == ["Accept", "Reject"]
        winner, loser = (a, b) if isinstance(a.answers("ra.0")[0], Accept) else (b, a)
        won, lost = ("ra.0", "rb.0") if winner is a else ("rb.0", "ra.0")
        # the answers say what the node holds for the other gateway: nothing yet
        assert all(m.foreign is not None for m in answers)  # type: ignore[attr-defined]
        # the loser may not abort the winner's request
        await until(lambda: len(winner.streamed[won]) >= 3, what="tokens flowing")
        await loser.tell(d, Abort(request_id=won))
        await loser.tell(p, Abort(request_id=won))
        # the loser's heartbeats carry the winner's request as foreign, never as held
        # (a first heartbeat may come after the first tokens: none yet is "not yet")
        await until(lambda: _beat(loser, "decode-0").load.foreign.decoding == 1,
                    what="foreign load")  # fmt: skip
        assert won not in loser.heartbeats["decode-0"].load.held
        await until(lambda: won in _beat(winner, "decode-0").load.held, what="held")
        # every token of the request reaches its gateway, in order, and only there
        await until(lambda: len(winner.streamed[won]) == 60, 20, "the whole stream")
        assert sorted(winner.streamed[won]) == list(range(60))
        assert won not in loser.streamed
        # the slot is free again: the loser's retry is taken, and streams to the loser alone
        await loser.offer(p, lost, d, 5)
        await until(lambda: any(isinstance(m, Accept) for m in loser.answers(lost)), what="ok")
        await until(lambda: len(loser.streamed[lost]) == 5, 20, "the retry's stream")
        assert lost not in winner.streamed
        # nothing left held, no block reserved twice or leaked
        await until(lambda: not p.requests and not d.requests and not d.intake.active)
        assert d.blocks.num_in_use_blocks == 0 and p.blocks.num_in_use_blocks == 0
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await a.close()
        await b.close()


async def test_kv_for_a_gateway_the_decode_node_does_not_serve_is_refused(tokenizer):
    """The prefill node serves gateway A only, the decode node gateway B only: the decode
    node refuses the KV of A's request (it could not stream its tokens anywhere) and the
    prefill node asks A for another decode node."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    prefill, decode = None, None
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [a])
        decode = await _node(tokenizer, DecodeRole, "decode-0", [b])
        await a.offer(prefill[0], "r.0", decode[0], 8)
        await until(lambda: any(isinstance(m, NeedDecode) for m in a.inbox), what="NeedDecode")
        need = next(m for m in a.inbox if isinstance(m, NeedDecode))
        assert need.request_id == "r.0" and need.refused_by == "decode-0"
        assert not [m for m in b.inbox if hasattr(m, "request_id")] and not b.streamed
        await until(lambda: not decode[0].intake.active)
        assert decode[0].blocks.num_in_use_blocks == 0
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await a.close()
        await b.close()


async def test_freed_room_goes_to_the_older_request_of_the_quieter_gateway(tokenizer):
    """Gateway A holds the one batch slot and offers its next request the moment its pass
    ends (a flooding gateway hears of freed room first: its own first token). Gateway B's
    request, refused during the pass and re-offered every 20 ms as a gateway's rounds do,
    has waited longer: the node keeps the room for it and A's younger offer gives way."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    prefill, decode = None, None
    try:
        # a long pass over a short prompt (little KV: the first token follows at once)
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [a, b], max_batch=1,
                              sim_time_scale=200.0)  # fmt: skip
        decode = await _node(tokenizer, DecodeRole, "decode-0", [a, b])
        p, d = prefill[0], decode[0]
        loop = asyncio.get_running_loop()

        async def flood(first: FirstToken) -> None:  # a1's pass ended: a2 at once, fresh
            if first.request_id == "a1.0":
                await a.offer(p, "a2.0", d, 2)

        a.on_first = flood
        await a.offer(p, "a1.0", d, 2)
        await until(lambda: a.answers("a1.0"), what="a1 answered")
        assert isinstance(a.answers("a1.0")[0], Accept)
        b_arrived = loop.time()

        async def b_rounds() -> None:
            """Three offers early in a1's pass (seconds long), then the next only after A's
            offer: B's round comes later than A's first token, the race the rule decides.
            The claim is held long enough to span the pass (HOLD_S is a few of a real
            gateway's rounds, which go on all the while)."""
            p.control.fairness.hold_s = 30.0
            for _ in range(3):
                await b.offer(p, "b1.0", d, 2, waited_ms=(loop.time() - b_arrived) * 1000)
                await asyncio.sleep(0.02)
            await until(lambda: a.answers("a2.0"), 20, "A's offer first")
            while not any(isinstance(m, Accept) for m in b.answers("b1.0")):
                await b.offer(p, "b1.0", d, 2, waited_ms=(loop.time() - b_arrived) * 1000)
                await asyncio.sleep(0.02)

        rounds = asyncio.create_task(b_rounds())
        await until(lambda: a.answers("a2.0"), 20, "a2 answered")
        assert isinstance(b.answers("b1.0")[0], Reject)  # refused during the pass: a claim
        first = a.answers("a2.0")[0]
        assert isinstance(first, Reject) and "older request" in first.reason, first
        await asyncio.wait_for(rounds, 10)  # b1 is taken
        await until(lambda: len(b.streamed["b1.0"]) == 2, 20, "b1's stream")
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await a.close()
        await b.close()


async def test_a_node_takes_pool_care_from_the_leader_alone(tokenizer):
    """Both gateways hear the node name the lowest gateway id as its leader; a role switch
    from the other one is ignored, the leader's is obeyed."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    decode = None
    try:
        decode = await _node(tokenizer, DecodeRole, "decode-0", [b, a])  # order does not matter
        d = decode[0]
        await until(lambda: all(g.heartbeats.get("decode-0") for g in (a, b)), what="beats")
        await until(lambda: _beat(b, "decode-0").leader == "gw-a", what="leader named")
        assert a.heartbeats["decode-0"].leader == "gw-a"
        await b.tell(d, SwitchRole(role="prefill"))
        # then an offer (a local prefill) it answers: a link's messages are handled in order,
        # so once it is answered the switch was handled too
        await b.offer(d, "probe.0", d, 2)
        await until(lambda: b.answers("probe.0"), what="the probe answered")
        assert not d.control.draining and d.control.switch_to is None
        await a.tell(d, SwitchRole(role="prefill"))
        await until(lambda: d.control.switch_to == "prefill", what="the leader's switch")
    finally:
        if decode is not None:
            decode[0].stopped.set()
            await asyncio.wait_for(decode[1], 10)
        await a.close()
        await b.close()


@contextlib.asynccontextmanager
async def _streaming_for_a(tokenizer: Any) -> AsyncIterator[tuple[Any, Any, Any]]:
    """Gateways A and B, a 1P1D cluster registered with both (a 1 s heartbeat timeout, a
    30 s orphan grace), and A's request r.0 decoding: (A, B, the decode node)."""
    a, b = ScriptedGateway("gw-a"), ScriptedGateway("gw-b")
    prefill, decode = None, None
    fast = {"heartbeat_timeout": 1.0, "orphan_grace": 30.0}  # a stall under 1 s is no silence
    try:
        prefill = await _node(tokenizer, PrefillRole, "prefill-0", [a, b], fast)
        decode = await _node(tokenizer, DecodeRole, "decode-0", [a, b], fast, sim_time_scale=20.0)
        await a.offer(prefill[0], "r.0", decode[0], 200)
        await until(lambda: len(a.streamed["r.0"]) >= 3, what="tokens to A")
        yield a, b, decode[0]
    finally:
        await _stop(*(x for x in (prefill, decode) if x is not None))
        await a.close()
        await b.close()


async def test_an_orphan_is_adopted_only_once_its_gateway_is_silent(tokenizer):
    """Gateway B asks for gateway A's running request: refused while A answers; once A has
    been silent for the node's heartbeat timeout, B adopts it, gets every token so far, and
    every later token; A gets none of those."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        refused = next(m for m in b.inbox if isinstance(m, Adopted))
        assert not refused.found and "live gateway" in refused.reason
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        had = len(a.streamed["r.0"])
        b.inbox.clear()
        await b.tell(d, Adopt(streams=[("r", had)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="adopted")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.request_id == "r.0"
        assert adopted.prompt_ids == prompt(32) and len(adopted.output_ids) >= had
        made = len(adopted.output_ids)
        await until(lambda: len(b.streamed["r.0"]) >= 3, what="tokens to B")
        assert min(b.streamed["r.0"]) == made  # indices go on from what it was handed
        assert max(a.streamed["r.0"]) < made  # A got nothing made after the adoption


async def test_an_orphan_its_node_gives_back_is_kept_for_its_adopter(tokenizer):
    """A decode node gives a running orphan back (preempted, or handed back as it drains):
    its Preempted has no gateway to go to, so its tokens wait for an adopter, which gets
    them with finish_reason "preempted" (it places the stream again: gateway/resume.py);
    before, the stream was gone (a resume found nothing: 404)."""
    async with _streaming_for_a(tokenizer) as (a, b, d):
        a.muted = True
        await until(lambda: d.control.links[0].silent_since is not None, what="A silent")
        made = len(d.requests["r.0"].seq.output_ids)
        await d.hand_back("draining")  # a preemption gives it back the same way
        await until(lambda: "r.0" not in d.requests, what="given back")
        assert d.blocks.num_in_use_blocks == 0
        await b.tell(d, Adopt(streams=[("r", 0)]))
        await until(lambda: [m for m in b.inbox if isinstance(m, Adopted)], what="an answer")
        adopted = next(m for m in b.inbox if isinstance(m, Adopted))
        assert adopted.found and adopted.finish_reason == "preempted"
        assert adopted.prompt_ids == prompt(32) and len(adopted.output_ids) >= made
