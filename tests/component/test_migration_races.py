"""A live migration's messages as a real gateway reads them, in the orders its two sockets
allow (gateway/node_messages.py): scripted nodes, each a control DEALER and a tokens PUSH,
send them one at a time, every one read before the next is sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from msgspec.structs import replace

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import (
    GATEWAY_DECODER,
    Accept,
    FirstToken,
    Heartbeat,
    KvTransferred,
    Load,
    Migrate,
    Msg,
    NeedDecode,
    PrefillOffer,
    Redirect,
    Register,
    RegisterAck,
    TokenBatch,
    encode,
)
from pdserve.common.wire.transport import make_socket
from pdserve.gateway.node_messages import CONTROL
from pdserve.gateway.requests import Done, GatewayRequest
from pdserve.gateway.table import Attempt
from tests.component.cluster import TIMEOUT, Cluster, outcome, prompt, until
from tests.unit.test_policies import make_info

RID = "r.0"


class Scripted:
    """A node whose every message the test writes: it registers, beats with a fixed load
    until closed, and keeps what the gateway sends it."""

    def __init__(self, c: Cluster, node_id: str, role: str, free: int = 100) -> None:
        self.node_id, self.free = node_id, free
        self.info = make_info(node_id, role, tokenizer_fingerprint=c.tokenizer.fingerprint(),
                              data_address=f"tcp://127.0.0.1:1/{node_id}")  # fmt: skip
        ctx = c.gw.link.ctx
        self.control = make_socket(ctx, "node.control", c.address, identity=f"{node_id}/x")
        self.tokens = make_socket(ctx, "decode.tokens", f"tcp://127.0.0.1:{c.gw.cfg.tokens_port}")
        self.inbox: list[Any] = []
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> Scripted:
        self.tasks.append(asyncio.create_task(self._read()))
        await self.send(Register(info=self.info))
        await until(lambda: any(isinstance(m, RegisterAck) for m in self.inbox), what="its ack")
        self.tasks.append(asyncio.create_task(self._beat()))
        return self

    async def send(self, msg: Msg) -> None:
        await self.control.send(encode(msg))

    async def push(self, rid: str, first: int, n: int, reason: str | None = None) -> None:
        """Tokens of output indices first .. first + n - 1, the last with `reason`."""
        indices = list(range(first, first + n))
        reasons: list[str | None] = [None] * (n - 1) + [reason]
        await self.tokens.send(encode(TokenBatch(node_id=self.node_id, request_ids=[rid] * n,
                                                 token_ids=[7] * n, indices=indices,
                                                 finish_reasons=reasons)))  # fmt: skip

    def got(self, kind: type) -> list[Any]:
        return [m for m in self.inbox if isinstance(m, kind)]

    async def _read(self) -> None:
        while True:
            self.inbox.append(GATEWAY_DECODER.decode(await self.control.recv()))

    async def _beat(self) -> None:
        while True:
            load = Load(running=0, waiting=0, blocks_free=self.free, blocks_cached=0,
                        blocks_in_use=self.info.num_blocks - self.free)  # fmt: skip
            await self.send(Heartbeat(node_id=self.node_id, load=load, reply=False))
            await asyncio.sleep(0.1)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.control.close()
        self.tokens.close()


@contextlib.asynccontextmanager
async def _nodes(tokenizer: Any, *specs: tuple[str, str, int]) -> AsyncIterator[Any]:
    async with Cluster(tokenizer) as c:
        nodes: list[Scripted] = []
        try:
            for node_id, role, free in specs:
                nodes.append(await Scripted(c, node_id, role, free).start())
            view = c.gw.cluster.nodes
            await until(lambda: all(view[n.node_id].load.blocks_free == n.free for n in nodes),
                        what="every node's load")  # fmt: skip
            yield c, nodes
        finally:
            for node in nodes:
                node.close()


async def _placed(c: Cluster, prefill: Scripted, max_tokens: int) -> tuple[GatewayRequest, str]:
    """A request the scripted prefill node accepts: (it, the decode node chosen)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = c.request("r", prompt(40), params)
    running = asyncio.create_task(c.gw.service.run(req))
    await until(lambda: bool(prefill.got(PrefillOffer)), what="the offer")
    (offer,) = prefill.got(PrefillOffer)
    await prefill.send(Accept(request_id=offer.request_id))
    await asyncio.wait_for(running, TIMEOUT)
    return req, offer.decode.node_id


def _attempt(c: Cluster) -> Attempt:
    attempt = c.gw.table.get(RID)
    assert attempt is not None
    return attempt


async def _redirect(node: Scripted, msg: Msg) -> Redirect:
    """`msg` from `node`, and the gateway's answer (a Redirect)."""
    before = len(node.got(Redirect))
    await node.send(msg)
    await until(lambda: len(node.got(Redirect)) > before, what="the gateway's answer")
    return node.got(Redirect)[-1]


def reads(monkeypatch: Any, kind: type) -> list[Any]:
    """Every message of `kind` the gateway has handled, once handled (answered or not)."""
    read: list[Any] = []
    handler = CONTROL[kind]

    async def reading(messages: Any, identity: bytes, msg: Any) -> None:
        await handler(messages, identity, msg)
        read.append(msg)

    monkeypatch.setitem(CONTROL, kind, reading)
    return read


def _transferred(rid: str) -> KvTransferred:
    return KvTransferred(request_id=rid, backend="zmq", bytes=1, layerwise=False,
                         start_ms=0.0, end_ms=1.0)  # fmt: skip


async def test_a_move_asked_before_the_first_token_is_read_is_answered_once_it_is(
    tokenizer, monkeypatch
):
    """The decode node admits the KV as it drains and asks where the sequence goes at once;
    its Migrate is read before the prefill node's FirstToken (another pipe). Moved then, the
    table named the mover the request's prefill side and dropped that FirstToken: the stream
    waited --stream-gap-timeout and was recomputed. Answered "stay" then, it was never asked
    again: decoded there for the rest of the drain, or handed back at its timeout and
    recomputed. The answer waits for that token, then moves it, every token kept."""
    specs = [("p", "prefill", 100), ("d0", "decode", 100), ("d1", "decode", 100)]
    async with _nodes(tokenizer, *specs) as (c, (p, *decode)):
        req, chosen = await _placed(c, p, max_tokens=5)
        d = next(n for n in decode if n.node_id == chosen)
        other = next(n for n in decode if n is not d)
        await d.push(RID, 1, 1)  # a step it made before it drained: held behind token 0
        migrates = reads(monkeypatch, Migrate)
        await d.send(Migrate(request_id=RID, reason="draining"))
        await until(lambda: bool(migrates), what="the Migrate read")
        assert not d.got(Redirect)  # not answered before its first token
        await p.send(FirstToken(request_id=RID, token_id=5))
        await until(lambda: bool(d.got(Redirect)), what="the answer")
        (moved,) = d.got(Redirect)
        assert moved.decode is not None and moved.decode.node_id == other.node_id
        await p.send(_transferred(RID))  # the prefill node's, after its FirstToken: stale now
        await d.send(_transferred(RID))
        await until(lambda: _attempt(c).prefill is None, what="the move over")
        await other.push(RID, 2, 3, "length")
        assert await outcome(req) == Done("length")
        assert req.output_ids == [5, 7, 7, 7, 7]
        assert c.gw.metrics.migrations.labels("moved")._value.get() == 1


async def test_a_move_s_refusal_is_sized_by_the_sequence_and_its_source_s_last_token_kept(
    tokenizer,
):
    """A sequence of 40 prompt tokens with 200 made moves from d0 to d1, which refuses it:
    the next target was sized by the prompt alone (d2, with room for 64 tokens), not by the
    240 tokens' KV the node sends. Then, moved, the source's last token read after its
    KvTransferred (the tokens socket is another pipe) was dropped: a hole in the stream."""
    specs = [("p", "prefill", 100), ("d0", "decode", 100)]
    async with _nodes(tokenizer, *specs) as (c, (p, d0)):
        req, _ = await _placed(c, p, max_tokens=1000)
        await p.send(FirstToken(request_id=RID, token_id=5))
        await d0.push(RID, 1, 199)
        await p.send(_transferred(RID))
        await until(lambda: len(req.output_ids) == 200 and _attempt(c).prefill is None,
                    what="200 tokens made on d0")  # fmt: skip
        d1 = await Scripted(c, "d1", "decode", free=100).start()
        d2 = await Scripted(c, "d2", "decode", free=4).start()  # 4 blocks: the prompt fits
        try:
            await until(lambda: c.gw.cluster.nodes["d2"].load.blocks_free == 4, what="loads")
            moved = await _redirect(d0, Migrate(request_id=RID, reason="rebalance"))
            assert moved.decode is not None and moved.decode.node_id == "d1"
            refused = NeedDecode(request_id=RID, refused_by="d1", reason="KV cache full")
            again = await _redirect(d0, refused)
            assert again.decode is None and _attempt(c).decode == "d0"  # d2 has no room
            d1_view = c.gw.cluster.nodes["d1"]
            await until(lambda: d1_view.refused_at < d1_view.load_at, what="d1's next report")
            assert (await _redirect(d0, Migrate(request_id=RID, reason="rebalance"))).decode
            await d0.send(_transferred(RID))  # on the control socket, read first
            await until(lambda: _attempt(c).prefill is None, what="the move over")
            await d0.push(RID, 200, 1)  # its last step's token, read after
            await d1.push(RID, 201, 2)
            await until(lambda: len(req.output_ids) == 203, 2.0, "every token, in order")
            await d0.push(RID, 200, 1)  # a late duplicate: dropped by its index
            await d1.push(RID, 203, 1)
            await until(lambda: len(req.output_ids) == 204, what="the next one")
            assert not req.pending
        finally:
            d1.close()
            d2.close()


def test_the_attempt_s_kv_size_counts_its_tokens_but_the_newest() -> None:
    from pdserve.gateway.table import RequestTable
    from tests.conftest import gateway_request

    req = gateway_request("k", 40)
    req.params = replace(req.params, max_tokens=100)
    attempt = RequestTable().open(req, 40)
    assert attempt.kv_len == 40  # nothing made yet: the prompt
    req.output_ids = [1]
    assert attempt.kv_len == 40  # the first token's KV is computed by the next step
    req.output_ids = [1] * 11
    assert attempt.kv_len == 50
