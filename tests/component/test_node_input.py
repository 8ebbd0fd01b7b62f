"""What the gateway reads off its node sockets, against a peer sending garbage in good form:
a token batch of thousands of ids outside 0..2**32-1 was logged one line per token (a 16 MB
batch: 4M lines, ~45 s on the gateway's event loop), now one line per batch at most every
10 s; a node id is bounded on the wire (a 64 MB one was logged, twice per line, and echoed
back in the refusal); and a transfer record with a negative byte count failed the metric
before the request's bookkeeping (its prefill node kept charged with it)."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from pdserve.common.node import handoff
from pdserve.common.wire.protocol import Preempted, Register, TokenBatch, encode
from pdserve.common.wire.transport import make_socket
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import TIMEOUT, Cluster, outcome, prompt, until


async def test_garbage_token_batches_and_huge_ids_make_few_short_log_lines(tokenizer, caplog):
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        ctx, n = c.gw.link.ctx, 20_000
        tokens = make_socket(ctx, "decode.tokens", f"tcp://127.0.0.1:{c.gw.cfg.tokens_port}")
        rogue = make_socket(ctx, "node.control", c.address, identity="rogue")
        counted = c.gw.metrics.node_messages.labels
        seen = {kind: counted(kind)._value.get() for kind in ("Preempted", "malformed")}
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="pdserve.gateway"):
                for _ in range(3):
                    await tokens.send(encode(TokenBatch(
                        node_id="decode-0", request_ids=["x.0"] * n, token_ids=[2**40] * n,
                        indices=[1] * n, finish_reasons=[None] * n)))  # fmt: skip
                huge = msgspec.structs.replace(prefill.info(), node_id="n" * 10**6)
                await rogue.send(encode(Register(info=huge)))  # decodes no more: dropped
                await tokens.send(encode(Preempted(node_id="d", request_id="y", reason="z")))
                await until(lambda: counted("Preempted")._value.get() > seen["Preempted"],
                            what="every message before it handled")  # fmt: skip
                await until(lambda: counted("malformed")._value.get() > seen["malformed"],
                            what="the huge id dropped")  # fmt: skip
        finally:
            tokens.close()
            rogue.close()
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) <= 2, said[:3]  # one for the batches, one for the huge Register
        assert all(len(line) < 500 for line in said), [line[:200] for line in said]
        assert any(f"{n} of the {n} tokens" in line for line in said), said
        assert "n" * 10**6 not in c.gw.cluster.nodes


async def test_a_negative_kv_byte_count_still_delivers_the_attempt(tokenizer, monkeypatch, caplog):
    real = handoff.KvTransferred
    monkeypatch.setattr(handoff, "KvTransferred", lambda **kw: real(**{**kw, "bytes": -1}))
    async with Cluster(tokenizer) as c:
        await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        req = c.request("neg", prompt(40))
        with caplog.at_level(logging.ERROR, logger="pdserve.gateway"):
            await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
            assert await outcome(req) == Done("length")
            await until(lambda: "kv_transfer.0" in req.timeline, what="the transfer recorded")
        assert req.timeline["kv_transfer.0"]["bytes"] == -1  # type: ignore[index]
        assert not [r for r in caplog.records if "KvTransferred failed" in r.getMessage()]
