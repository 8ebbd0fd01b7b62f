"""The wire: protocol codecs, and a gateway with prefill and decode nodes over real ZeroMQ
sockets, all in one process and one event loop (sim engine, plus the real SmolLM2 model
for byte-exact KV transfer)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import typing
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdserve.common.config import EngineConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.node import NodeRequest, NodeRuntime, RegistrationRefused
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.kv_messages import (
    PREFIX_GONE,
    TO_DECODE_DECODER,
    TO_PREFILL_DECODER,
    DecodeToPrefill,
    KvAck,
    KvDone,
    KvFetch,
    KvGrant,
    KvHeader,
    KvLayer,
    KvRefuse,
    PrefillToDecode,
)
from pdserve.common.wire.protocol import (
    GATEWAY_DECODER,
    NODE_DECODER,
    TOKENS_DECODER,
    Abort,
    Accept,
    Adopt,
    Adopted,
    DecodeTarget,
    DecodeToGateway,
    Deregister,
    Drain,
    FirstToken,
    Fits,
    Foreign,
    GatewayToNode,
    Heartbeat,
    HeartbeatReply,
    KvEvents,
    KvTransferred,
    Load,
    Migrate,
    Msg,
    NeedDecode,
    NodeInfo,
    NodeToGateway,
    Preempted,
    PrefillFailed,
    PrefillOffer,
    Probe,
    Rebalance,
    Redirect,
    Register,
    RegisterAck,
    RegisterRefuse,
    Reject,
    Release,
    SwitchRole,
    TokenBatch,
    Wanted,
    encode,
)
from pdserve.common.wire.transport import decode_or_none, make_socket, send
from pdserve.decode_node.server import DecodeRole
from pdserve.gateway.requests import Done, Failed
from pdserve.prefill_node.server import PrefillRole
from tests.component.cluster import (
    PARAMS,
    SIM,
    TIMEOUT,
    Cluster,
    digest,
    outcome,
    prompt,
    until,
)

# -- 1. protocol ---------------------------------------------------------------------------
INFO = NodeInfo(
    node_id="p-1",
    role="prefill",
    data_address="tcp://10.0.0.1:5000",
    host_id="h/ipc:[1]",
    model_id="m",
    dtype="float32",
    tokenizer_fingerprint="abc",
    kv_layout="30x3x64",
    block_size=16,
    num_blocks=100,
    max_batch=4,
    max_batch_tokens=8192,
    max_model_len=2048,
)
LOAD = Load(
    running=1,
    waiting=2,
    blocks_free=3,
    blocks_cached=4,
    blocks_in_use=5,
    held=("a.0", "b.1"),
    draining=True,
)
TARGET = DecodeTarget(node_id="d-1", data_address="tcp://10.0.0.2:6000", host_id="h2")
FULL_PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=20,
    seed=3,
    stop=("x", "yz"),
    stop_token_ids=(2, 9),
    ignore_eos=True,
)
SAMPLES: list[Msg] = [
    Register(info=INFO),
    Heartbeat(node_id="p-1", load=LOAD),
    Heartbeat(
        node_id="p-1",
        load=LOAD,
        kv_seq=4,
        events=KvEvents(node_id="p-1", seq=4, stored=[b"\x03" * 16]),
        reply=False,
    ),
    Accept(request_id="r.0"),
    Reject(request_id="r.0", reason="batch full"),
    Reject(request_id="r.0", reason="stale view", room=90, foreign=Foreign(prefill=(12, 400))),
    FirstToken(request_id="r.0", token_id=5, finish_reason="length", prefill_ms=1.5, queue_ms=2),
    NeedDecode(request_id="r.0", refused_by="d-1", reason="full"),
    PrefillFailed(request_id="r.0", reason="boom"),
    Migrate(request_id="r.0", reason="draining"),
    Deregister(node_id="p-1"),
    Adopted(
        request_id="r.1",
        found=True,
        prompt_ids=[1, 2],
        output_ids=[7, 8, 9],
        base=1,
        params=FULL_PARAMS,
        finish_reason=None,
    ),
    Adopted(request_id="r", found=False, reason="the stream is served by a live gateway"),
    Adopt(streams=[("r", 2), ("s", 0)]),
    Wanted(request_id="r.0"),
    Release(request_id="r.0"),
    RegisterAck(node_id="p-1", tokens_address="tcp://127.0.0.1:8002"),
    RegisterRefuse(node_id="p-1", reason="dtype"),
    Probe(
        node_id="p-1",
        model_id="m",
        dtype="float32+int4",
        tokenizer_fingerprint="f",
        kv_layout="0123456789ab",
    ),
    Fits(node_id="p-1"),
    HeartbeatReply(stale=("r.0",), unknown_node=True),
    PrefillOffer(request_id="r.1", prompt_ids=[1, 2, 3], params=FULL_PARAMS, decode=TARGET),
    PrefillOffer(
        request_id="r.1", prompt_ids=[1], params=FULL_PARAMS, decode=TARGET, foreign_prefill=412
    ),
    Redirect(request_id="r.0", decode=TARGET),
    Redirect(request_id="r.0", decode=None),
    Abort(request_id="r.0"),
    Drain(),
    Rebalance(request_ids=("r.0", "r.1")),
    SwitchRole(role="prefill"),
    KvHeader(
        request_id="r.0",
        prompt_ids=[4, 5, 6],
        num_prompt_tokens=2,
        params=FULL_PARAMS,
        num_layers=30,
        frame_bytes=1024,
        prefill_node="p-1",
    ),
    KvLayer(request_id="r.0", layer=29),
    KvDone(request_id="r.0", first_token_id=77),
    KvAck(request_id="r.0"),
    KvRefuse(request_id="r.0", reason="needs 3 KV blocks, 1 free"),
    KvGrant(request_id="r.0", ticket=3, nonce=(1 << 62) + 1, block_table=[7, 8, 9]),
    TokenBatch(
        node_id="d-1",
        request_ids=["a.0", "b.0"],
        token_ids=[1, 2],
        indices=[3, 1],
        finish_reasons=[None, "stop"],
    ),
    Preempted(node_id="d-1", request_id="a.0", reason="out of KV blocks"),
    KvTransferred(
        request_id="r.0",
        backend="shm",
        bytes=4096,
        layerwise=True,
        start_ms=1.0,
        end_ms=2.5,
        overlap_ms=0.4,
    ),
    KvEvents(node_id="p-1", seq=3, stored=[b"\x01" * 16], evicted=[b"\x02" * 16]),
    KvFetch(request_id="r.0/fetch", prompt_ids=list(range(32)), skip_tokens=16, reply_to=TARGET),
]
CHANNELS = [
    (NODE_DECODER, NodeToGateway),
    (GATEWAY_DECODER, GatewayToNode),
    (TO_DECODE_DECODER, PrefillToDecode),
    (TO_PREFILL_DECODER, DecodeToPrefill),
    (TOKENS_DECODER, DecodeToGateway),
]


def test_every_message_round_trips_through_its_channel_only():
    assert {type(m) for m in SAMPLES} == set(Msg.__subclasses__()), "a message lacks a sample"
    for msg in SAMPLES:
        data = encode(msg)
        channels = 0
        for decoder, union in CHANNELS:
            decoded = decode_or_none(decoder, data)
            if type(msg) in typing.get_args(union):
                channels += 1
                assert decoded == msg and type(decoded) is type(msg), (msg, decoder)
            else:
                assert decoded is None, (msg, union)
        assert channels >= 1, f"{type(msg).__name__} is on no channel"


def test_a_register_of_an_older_or_newer_version_reads_with_what_both_know():
    """A rolling update mixes versions: a `Register` without `features` (older) reads as a
    node with none, one with fields this version lacks (newer) drops them."""
    fields = {k: v for k, v in msgspec.structs.asdict(INFO).items() if k != "features"}
    older = msgspec.msgpack.encode({"type": "Register", "info": fields})
    assert decode_or_none(NODE_DECODER, older) == Register(info=INFO)
    newer = dict(fields, features=["release-tokens", "not-yet"], later_field=[1, 2])
    got = decode_or_none(NODE_DECODER, msgspec.msgpack.encode({"type": "Register", "info": newer}))
    assert got == Register(
        info=msgspec.structs.replace(INFO, features=("release-tokens", "not-yet"))
    )


@pytest.mark.parametrize("decoder", [d for d, _ in CHANNELS])
def test_garbage_and_malformed_messages_are_rejected(decoder):
    offer = msgspec.to_builtins(next(m for m in SAMPLES if isinstance(m, PrefillOffer)))
    bad_params = {**offer, "params": {**offer["params"], "max_tokens": 0}}
    garbage = [
        b"",
        b"\xc1",
        b"not msgpack at all",
        b"\x93\x01\x02",  # truncated array
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "NoSuchMessage", "request_id": "r.0"}),
        msgspec.msgpack.encode({"type": "Accept"}),  # missing field
        msgspec.msgpack.encode({"type": "Abort", "request_id": 7}),  # wrong type
        msgspec.msgpack.encode({"type": "KvAck", "request_id": ["r"]}),
        msgspec.msgpack.encode({"type": "TokenBatch", "node_id": "d", "request_ids": "x"}),
        msgspec.msgpack.encode(bad_params),  # SamplingParams validation fails
        encode(SAMPLES[0])[:-3],  # truncated valid message
    ]
    for data in garbage:
        assert decode_or_none(decoder, data) is None, data


# -- 2. registration -----------------------------------------------------------------------
class RawNode:
    """A control DEALER driven by hand: a node process as the gateway sees it."""

    def __init__(self, address: str, identity: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, "node.control", address, identity=identity)

    async def ask(self, msg: Msg) -> Any:
        await send(self.sock, msg)
        return GATEWAY_DECODER.decode(await asyncio.wait_for(self.sock.recv(), TIMEOUT))

    def close(self) -> None:  # a crash: no Deregister
        self.sock.close()
        self.ctx.term()


async def test_nodes_register_and_mismatched_ones_are_refused(tokenizer):
    async with Cluster(tokenizer) as c:
        assert c.gw.cluster.health() is not None
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        assert set(c.gw.cluster.nodes) == {"prefill-0", "decode-0"}
        assert c.gw.cluster.health() is None
        assert c.gw.cluster.nodes["decode-0"].info == decode.info()
        assert c.gw.cluster.nodes["decode-0"].info.data_address.startswith("tcp://127.0.0.1:")
        # the gateway leaves its tokens host empty: the node uses the host it registered to
        port = c.gw.link.tokens_address.rsplit(":", 1)[1]
        assert decode.control.links[0].tokens_address == f"tcp://127.0.0.1:{port}"
        assert decode.control.links[0].tokens_sock is not None
        # heartbeats carry the load to the gateway
        await until(lambda: c.gw.cluster.nodes["prefill-0"].load.blocks_free == 256, 2)

        for name, value in (("dtype", "bfloat16"), ("model_id", "another-model")):
            odd = c.node(PrefillRole, f"odd-{name}")
            info = odd.info
            odd.info = lambda info=info, name=name, value=value: msgspec.structs.replace(
                info(), **{name: value}
            )
            with pytest.raises(RegistrationRefused, match=name):
                await asyncio.wait_for(c.start(odd), TIMEOUT)
            assert odd.stopped.is_set() and not odd.registered.is_set()
            assert f"odd-{name}" not in c.gw.cluster.nodes

        # another socket cannot speak for a registered node
        other = RawNode(c.address, "someone-else")
        try:
            reply = await other.ask(Heartbeat(node_id="prefill-0", load=LOAD))
            assert reply == HeartbeatReply(stale=(), unknown_node=True)
            await send(other.sock, Deregister(node_id="prefill-0"))
            await asyncio.sleep(0.1)
        finally:
            other.close()
        assert set(c.gw.cluster.nodes) == {"prefill-0", "decode-0"}
        assert c.gw.cluster.nodes["prefill-0"].load.held == ()  # not LOAD's
        assert c.gw.cluster.health() is None
        assert prefill.registered.is_set()


async def test_same_node_id_is_refused_and_keeps_the_first(tokenizer):
    async with Cluster(tokenizer) as c:
        first = await c.add(c.node(PrefillRole, "twin"))
        first_info = first.info()
        for ecfg in (dataclasses.replace(SIM, max_batch=2), SIM):  # other config, or the same
            twin = c.node(PrefillRole, "twin", ecfg=ecfg)
            with pytest.raises(RegistrationRefused, match="already registered"):
                await asyncio.wait_for(c.start(twin), TIMEOUT)
            await asyncio.sleep(0.1)  # let anything the refused node sent on its way arrive
            assert c.gw.cluster.nodes["twin"].info == first_info
        assert first.registered.is_set()
        # the first node is still the one the gateway talks to: it takes a request
        await c.add(c.node(DecodeRole, "decode-0"))
        req = c.request("r", prompt(20))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")
        assert c.gw.cluster.nodes["twin"].accepts == 1


async def test_a_node_that_lost_the_ack_registers_again(tokenizer):
    """The same process (socket) re-sending the same Register is welcome. A new process under
    its id (a restart) is not answered while the old one may be alive, and replaces it once
    the old one has been silent for twice its heartbeats' gap: long before its lease ends."""
    async with Cluster(tokenizer, heartbeat_timeout=30.0) as c:
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        info = msgspec.structs.replace(decode.info(), node_id="decode-1", data_address="")
        old = RawNode(c.address, "decode-1/old")
        assert isinstance(await old.ask(Register(info=info)), RegisterAck)
        assert isinstance(await old.ask(Register(info=info)), RegisterAck)
        for _ in range(3):  # beats 0.1 s apart: it is dead after about 0.2 s of silence
            await asyncio.sleep(0.1)
            await send(old.sock, Heartbeat(node_id="decode-1", load=LOAD))
            sent = time.monotonic()
        await until(lambda: c.gw.cluster.nodes["decode-1"].last_seen >= sent, 2, "beats read")
        old.close()
        gap, silent_from = c.gw.cluster.nodes["decode-1"].beat_gap, time.monotonic()
        heard = c.gw.cluster.nodes["decode-1"].last_seen
        new = RawNode(c.address, "decode-1/new")
        try:
            while True:  # as a node does: registers again at each beat until answered
                await send(new.sock, Register(info=info))
                try:
                    reply = GATEWAY_DECODER.decode(await asyncio.wait_for(new.sock.recv(), 0.05))
                    break
                except asyncio.TimeoutError:
                    assert time.monotonic() - silent_from < 5, "never replaced"
            waited = time.monotonic() - heard
            assert isinstance(reply, RegisterAck), reply
            assert c.gw.cluster.nodes["decode-1"].identity == b"decode-1/new"
            # not before twice the gap it beat at (0.1 s or more, as the gateway read them);
            # far below half the 30 s lease (a loaded host adds its scheduling delays)
            assert 2 * gap <= waited < 5, (gap, waited)
            assert "decode-0" in c.gw.cluster.nodes
        finally:
            new.close()


# -- 3. offers, accepts, rejects -----------------------------------------------------------
async def test_full_prefill_node_rejects_and_every_request_completes(tokenizer):
    # a slower prefill (x2 the modelled time, ~18 ms) so offers arrive while a batch runs
    slow = EngineConfig(engine="sim", sim_time_scale=2.0, num_kv_blocks=256, max_batch=1)
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0", ecfg=slow))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        sched = prefill.scheduler
        peak = {"held": 0, "batch": 0}
        can_take, schedule = sched.can_take, sched.schedule

        def counting_can_take(n, queueing, pending=()):
            reason = can_take(n, queueing, pending)
            held = len(sched.waiting) + len(sched.running) + (reason is None)
            peak["held"] = max(peak["held"], held)
            return reason

        def counting_schedule():
            out = schedule()
            peak["batch"] = max(peak["batch"], len(out.prefills))
            return out

        sched.can_take, sched.schedule = counting_can_take, counting_schedule

        reqs = [c.request(f"r{i}", prompt(20 + i, 1000 + 100 * i)) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*(c.gw.service.run(r) for r in reqs)), TIMEOUT)
        events = [await outcome(r) for r in reqs]
        assert all(e == Done("length") for e in events), events
        assert all(len(r.output_ids) == PARAMS.max_tokens and r.attempt == 0 for r in reqs)
        state = c.gw.cluster.nodes["prefill-0"]
        assert peak == {"held": 1, "batch": 1}
        assert state.accepts == len(reqs)
        assert state.rejects > 0
        await until(lambda: not prefill.requests and not decode.requests, what="idle nodes")
        assert prefill.blocks.num_in_use_blocks == 0 and decode.blocks.num_in_use_blocks == 0
        assert not c.gw.table


async def test_unreachable_prefill_node_is_skipped(tokenizer):
    """A prefill node that vanished (no Deregister, heartbeat timeout not yet passed) must
    not break placement: the offer fails and the next node gets it."""
    async with Cluster(tokenizer, heartbeat_timeout=30.0) as c:
        real = await c.add(c.node(PrefillRole, "prefill-b"))
        await c.add(c.node(DecodeRole, "decode-0"))
        ghost = RawNode(c.address, "prefill-a/1")
        info = msgspec.structs.replace(real.info(), node_id="prefill-a")
        assert isinstance(await ghost.ask(Register(info=info)), RegisterAck)
        ghost.close()
        await asyncio.sleep(0.2)
        assert "prefill-a" in c.gw.cluster.nodes  # offered first: fewest in prefill, then id

        req = c.request("r", prompt(30))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")
        unanswered = c.gw.metrics.offer_timeouts.labels("prefill-a")._value.get()
        assert unanswered == 1 and c.gw.cluster.nodes["prefill-a"].rejects == 0
        assert c.gw.cluster.nodes["prefill-b"].accepts == 1


# -- 4. KV frames --------------------------------------------------------------------------
async def test_kv_reaches_the_decode_node_and_both_sides_free_it(tokenizer):
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        frames: dict[str, list[tuple[int, int]]] = {}
        import_kv = decode.engine.kv_store.import_kv

        def recording_import(layer, block_table, num_tokens, frame):
            rid = next(iter(decode.intake.incoming))
            frames.setdefault(rid, []).append((layer, len(frame)))
            import_kv(layer, block_table, num_tokens, frame)

        decode.engine.kv_store.import_kv = recording_import  # type: ignore[method-assign]
        n = 37  # not a multiple of the block size
        req = c.request("r", prompt(n))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")
        layers = decode.engine.model_config.num_layers
        size = decode.engine.kv_store.frame_bytes(n)
        assert frames == {"r.0": [(i, size) for i in range(layers)]}
        assert len(req.output_ids) == PARAMS.max_tokens
        await until(
            lambda: prefill.blocks.num_in_use_blocks == 0 and decode.blocks.num_in_use_blocks == 0,
            1.0,
            "KV freed on both nodes",
        )
        assert not prefill.requests and not decode.requests and not decode.intake.incoming


async def test_torch_kv_arrives_byte_exact(tokenizer, torch_runners):
    ecfg, prefill_runner, decode_runner, _ = torch_runners
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0", ecfg=ecfg, engine=prefill_runner))
        decode = await c.add(c.node(DecodeRole, "decode-0", ecfg=ecfg, engine=decode_runner))
        held = decode.blocks.allocate(3)  # so the decode side's block table differs
        snapshots: dict[str, tuple[list[str], list[str]]] = {}
        admit = decode.role.admit_kv

        async def snapshotting_admit(intake, token):
            rid = intake.header.request_id
            table = prefill.requests[rid].seq.block_table
            n = len(intake.header.prompt_ids)
            assert intake.block_table != table
            layers = range(decode_runner.model_config.num_layers)
            snapshots[rid] = (
                [digest(prefill_runner.kv_store.export_kv(i, table, n)) for i in layers],
                [
                    digest(decode_runner.kv_store.export_kv(i, intake.block_table, n))
                    for i in layers
                ],
            )
            await admit(intake, token)

        decode.intake.admit = snapshotting_admit
        ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, then it rests.")
        assert len(ids) % prefill_runner.block_size != 0
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        req = c.request("t", ids, params)
        await asyncio.wait_for(c.gw.service.run(req), 30)
        assert await outcome(req, 30) == Done("length")
        sent, received = snapshots["t.0"]
        assert len(sent) == prefill_runner.model_config.num_layers
        assert len(set(sent)) == len(sent)  # real, distinct layers (not an empty cache)
        assert received == sent
        await until(lambda: decode.blocks.num_in_use_blocks == 3, 2, "decode frees the request")
        await until(lambda: prefill.blocks.num_in_use_blocks == 0, 2, "prefill frees the KV")
        decode.blocks.free(held)


# -- 5. abort ------------------------------------------------------------------------------
async def test_abort_while_decoding_frees_the_decode_node(tokenizer):
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        # room for ~65k tokens: it never runs out of blocks (preemption would free them too)
        big = dataclasses.replace(SIM, num_kv_blocks=4096)
        decode = await c.add(c.node(DecodeRole, "decode-0", ecfg=big))
        long = SamplingParams(max_tokens=50_000, temperature=0.0, ignore_eos=True)
        req = c.request("r", prompt(40), long)
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        await until(lambda: len(req.output_ids) >= 5, what="decoding")
        assert decode.blocks.num_in_use_blocks > 0 and "r.0" in decode.requests
        c.gw.service.abort(req)
        event = await outcome(req, 5.0)  # kept instead, it would run for its 50,000 tokens
        assert isinstance(event, Failed) and event.status == 499
        await until(lambda: decode.blocks.num_in_use_blocks == 0, 5.0, "decode frees the KV")
        assert not decode.requests and prefill.blocks.num_in_use_blocks == 0 and req.attempt == 0
        produced = len(req.output_ids)
        await asyncio.sleep(0.05)
        assert len(req.output_ids) == produced  # nothing is decoded for it any more
        assert not c.gw.table


# -- 6. decode refusal, redirect, re-placement ---------------------------------------------
# The gateway picks a decode node from the load it last reported; when blocks were taken
# since (here: by another tenant, and the node keeps reporting its earlier load until it
# refuses), the node answers the KV header with KvRefuse and the prefill node asks for
# another decode node (NeedDecode -> Redirect).
SMALL = EngineConfig(engine="sim", sim_time_scale=0.01, num_kv_blocks=64)
MEDIUM = EngineConfig(engine="sim", sim_time_scale=0.01, num_kv_blocks=48)
LONG_PROMPT = 600  # 38 blocks with its first token
OCCUPIED = 40  # of SMALL's 64: 24 free, so it refuses


class StaleView:
    """`occupy` blocks of the node are taken while it reports its earlier load; the node
    reports honestly again from its first refusal on, and `free_on_refusal` gives the
    blocks back then."""

    def __init__(self, node: NodeRuntime, occupy: int, free_on_refusal: bool) -> None:
        self.node, self.refusals = node, []
        earlier, honest = node.load(), node.load
        self.held = node.blocks.allocate(occupy)
        node.load = lambda: earlier  # type: ignore[method-assign]
        refuse = node.intake.refuse

        async def refusing(peer: bytes, rid: str, reason: str) -> None:
            self.refusals.append((rid, reason))
            node.load = honest  # type: ignore[method-assign]
            if free_on_refusal:
                self.release()
            await refuse(peer, rid, reason)

        node.intake.refuse = refusing  # type: ignore[method-assign]

    def release(self) -> None:
        if self.held:
            self.node.blocks.free(self.held)
            self.held = []


def record_redirects(prefill: NodeRuntime) -> list[DecodeTarget | None]:
    redirects: list[DecodeTarget | None] = []
    handoff = prefill.role.handoff
    on_redirect = handoff.send_kv

    async def recording(rid: str, target: DecodeTarget | None) -> None:
        redirects.append(target)
        await on_redirect(rid, target)

    handoff.send_kv = recording  # type: ignore[method-assign]
    return redirects


def all_free(*nodes: Any) -> Callable[[], bool]:
    return lambda: all(n.blocks.num_in_use_blocks == 0 for n in nodes)


async def test_refused_kv_is_redirected_to_another_decode_node(tokenizer):
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        small = await c.add(c.node(DecodeRole, "decode-small", ecfg=SMALL))
        medium = await c.add(c.node(DecodeRole, "decode-medium", ecfg=MEDIUM))
        stale = StaleView(small, OCCUPIED, free_on_refusal=False)
        await until(lambda: c.gw.cluster.nodes["decode-medium"].load.blocks_free == 48)
        await until(lambda: c.gw.cluster.nodes["decode-small"].load.blocks_free == 64)
        redirects = record_redirects(prefill)
        req = c.request("r", prompt(LONG_PROMPT))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req) == Done("length")
        assert stale.refusals == [("r.0", "needs 38 KV blocks, 24 free")]
        assert [t and t.node_id for t in redirects] == ["decode-medium"]
        assert req.attempt == 0 and len(req.output_ids) == PARAMS.max_tokens
        stale.release()
        await until(all_free(prefill, small, medium), 1.0, "all KV freed")
        assert not small.intake.incoming and not small.requests and not prefill.requests


async def test_a_redirect_during_a_forward_pass_never_holds_up_the_control_loop(tokenizer):
    """The redirected request's resend waits for the running pass; the loop that answers
    offers must not wait with it (an offer unanswered for --offer-timeout is lost)."""
    async with Cluster(tokenizer) as c:
        node = c.node(PrefillRole, "prefill-0")
        seq = Sequence.new("r.0", prompt(10), PARAMS)
        node.scheduler.parked["r.0"] = seq  # prefilled, its KV held for the handoff
        node.requests["r.0"] = NodeRequest(seq, target=TARGET)
        node.steps.in_step = {"r.0"}  # and a pass that involves it is still running
        node.steps.step_over = asyncio.get_running_loop().create_future()
        redirect = node.role.on_gateway_message(Redirect(request_id="r.0", decode=None))
        await asyncio.wait_for(redirect, 2.0)  # deferred, not waiting for the pass
        await asyncio.sleep(0.05)
        assert "r.0" in node.requests  # applied only once the pass is over
        node.steps.in_step = set()
        node.steps.step_over.set_result(None)
        await until(lambda: "r.0" not in node.requests, 1.0, "the redirect to be applied")
        await node.shutdown()


async def test_refused_kv_with_no_other_decode_node_is_placed_again(tokenizer):
    async with Cluster(tokenizer, offer_timeout=0.5, placement_timeout=3.0) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        small = await c.add(c.node(DecodeRole, "decode-small", ecfg=SMALL))
        stale = StaleView(small, OCCUPIED, free_on_refusal=True)
        await until(lambda: c.gw.cluster.nodes["decode-small"].load.blocks_free == 64)
        redirects = record_redirects(prefill)
        req = c.request("r", prompt(LONG_PROMPT))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req, 5.0) == Done("length")
        assert len(stale.refusals) == 1 and redirects == [None]
        assert req.attempt == 1  # re-placed as a prefill of prompt + first token
        assert len(req.output_ids) == PARAMS.max_tokens
        await until(all_free(prefill, small), 1.0, "all KV freed")
        assert not prefill.requests and not c.gw.table


async def test_refused_kv_with_no_room_anywhere_fails_cleanly(tokenizer):
    async with Cluster(tokenizer, offer_timeout=0.5, placement_timeout=0.5) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        small = await c.add(c.node(DecodeRole, "decode-small", ecfg=SMALL))
        stale = StaleView(small, OCCUPIED, free_on_refusal=False)
        await until(lambda: c.gw.cluster.nodes["decode-small"].load.blocks_free == 64)
        req = c.request("r", prompt(LONG_PROMPT))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        event = await outcome(req, 5.0)
        assert isinstance(event, Failed) and event.status == 503, event
        assert len(stale.refusals) == 1 and req.attempt == 1
        await until(
            lambda: prefill.blocks.num_in_use_blocks == 0 and not prefill.requests,
            1.0,
            "prefill frees the refused KV",
        )
        assert small.blocks.num_in_use_blocks == OCCUPIED and not small.intake.incoming
        assert not small.requests and not c.gw.table
        stale.release()


async def test_failed_prefill_is_placed_again(tokenizer):
    async with Cluster(tokenizer, offer_timeout=0.5, placement_timeout=3.0) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        step, calls = prefill.engine.step, []

        def failing_once(*args: Any, **kwargs: Any) -> list[int]:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected engine failure")
            return step(*args, **kwargs)

        prefill.engine.step = failing_once
        req = c.request("r", prompt(50))
        await asyncio.wait_for(c.gw.service.run(req), TIMEOUT)
        assert await outcome(req, 5.0) == Done("length")
        assert req.attempt == 1 and len(calls) == 2
        assert len(req.output_ids) == PARAMS.max_tokens
        # the reservation the failed attempt made on the decode node is aborted
        await until(all_free(prefill, decode), 1.0, "all KV freed")
        assert not decode.intake.incoming and not decode.requests


# -- 6. the prefix index -------------------------------------------------------------------
async def test_the_gateway_prefix_index_follows_the_nodes_caches(tokenizer):
    """After shared-prefix traffic, evictions, a lost event batch and a node restart, the
    gateway's index of every node equals what that node's cache holds."""
    tiny = EngineConfig(engine="sim", sim_time_scale=0.01, num_kv_blocks=24, max_batch=8)
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0", ecfg=tiny))
        decode = await c.add(c.node(DecodeRole, "decode-0", ecfg=tiny))

        def consistent() -> bool:
            index = c.gw.index
            return all(
                not index.needs_snapshot(n.node_id)
                and index.nodes[n.node_id].blocks == set(n.blocks.cached_hashes())
                for n in (prefill, decode)
            )

        async def serve(*prompts: list[int]) -> None:
            reqs = [c.request(f"q{i}-{len(p)}-{p[0]}", p) for i, p in enumerate(prompts)]
            await asyncio.wait_for(asyncio.gather(*(c.gw.service.run(r) for r in reqs)), TIMEOUT)
            assert all([await outcome(r) == Done("length") for r in reqs])

        shared = prompt(64, 2000)
        await serve(shared + prompt(10, 9000), shared + prompt(20, 9100))
        await until(consistent, what="the index to match the caches")
        assert c.gw.index.cached_blocks("prefill-0", prefill.blocks.hashes(shared)) == 4
        await serve(prompt(360, 5000))  # 23 of the 24 blocks: evicts the shared prefix
        await until(consistent, what="evictions to reach the index")
        assert c.gw.index.cached_blocks("prefill-0", prefill.blocks.hashes(shared)) < 4

        take, dropped = prefill.events.take, []

        def losing() -> list[KvEvents]:  # the next KvEvents never arrives
            msgs = take()
            if msgs and not dropped:
                dropped.append(msgs[0].seq)
                return msgs[1:]
            return msgs

        prefill.events.take = losing  # type: ignore[method-assign]
        await serve(shared + prompt(5, 7000))
        await serve(prompt(40, 3000))
        await until(lambda: dropped and consistent(), what="a resync after the lost batch")

        await c.stop(prefill, next(t for n, t in c.tasks.values() if n is prefill))
        fresh = await c.add(c.node(PrefillRole, "prefill-0", ecfg=tiny))
        prefill = fresh
        await until(consistent, what="the restarted node's empty cache in the index")
        assert c.gw.index.nodes["prefill-0"].blocks == set()


async def test_kv_the_decode_node_no_longer_holds_is_sent_whole_after_all(tokenizer):
    """The index said the decode node holds the conversation (a stale view: its evictions
    were not published yet); it refuses the header, and the prefill node sends everything."""
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        decode = await c.add(c.node(DecodeRole, "decode-0"))
        first = c.request("turn1", prompt(70, 4000))
        await asyncio.wait_for(c.gw.service.run(first), TIMEOUT)
        assert await outcome(first) == Done("length")
        history = first.prompt_ids + first.output_ids
        hashes = decode.blocks.hashes(history)
        await until(lambda: c.gw.index.cached_blocks("decode-0", hashes) == 4, what="indexed")

        def silent() -> list[KvEvents]:  # its evictions stay unpublished
            return []

        decode.events.take = silent  # type: ignore[method-assign]
        everything = decode.blocks.allocate(decode.blocks.num_free_blocks)  # evicts it all
        decode.blocks.free(everything)
        refusals: list[str] = []
        refuse = decode.intake.refuse

        async def recording(peer: bytes, rid: str, reason: str) -> None:
            refusals.append(reason)
            await refuse(peer, rid, reason)

        decode.intake.refuse = recording  # type: ignore[method-assign]
        second = c.request("turn2", history + prompt(9, 8000))
        await asyncio.wait_for(c.gw.service.run(second), TIMEOUT)
        assert await outcome(second) == Done("length")
        assert len(refusals) == 1 and refusals[0].startswith(PREFIX_GONE)
        assert second.attempt == 0  # resent by the prefill node, no re-placement
        await until(lambda: not prefill.requests and not decode.requests, what="idle")


async def test_an_accept_for_a_request_whose_client_left_meanwhile_links_nothing(tokenizer):
    """The client leaves while its offer is out; the node accepts after that. The closed
    attempt must not be committed (a node linked to a wire id the table no longer has broke
    every later placement with a KeyError): the node is told to abort, and nothing leaks."""
    async with Cluster(tokenizer) as c:
        prefill = await c.add(c.node(PrefillRole, "prefill-0"))
        await c.add(c.node(DecodeRole, "decode-0"))
        offered, release = asyncio.Event(), asyncio.Event()
        on_offer = prefill.role._on_offer

        async def slow_offer(offer):  # type: ignore[no-untyped-def]
            offered.set()
            await release.wait()
            await on_offer(offer)

        prefill.role._on_offer = slow_offer  # type: ignore[method-assign]
        req = c.request("gone", prompt(30))
        run = asyncio.create_task(c.gw.service.run(req))
        await asyncio.wait_for(offered.wait(), TIMEOUT)
        c.gw.service.abort(req)  # the client disconnects with the offer in flight
        release.set()
        await asyncio.wait_for(run, TIMEOUT)
        await until(lambda: not prefill.requests, what="the node was told to abort")
        assert not c.gw.table and all(not c.gw.table.on_node(n) for n in c.gw.cluster.nodes)
        prefill.role._on_offer = on_offer  # type: ignore[method-assign]
        after = c.request("after", prompt(30, 3000))
        await asyncio.wait_for(c.gw.service.run(after), TIMEOUT)
        assert await outcome(after) == Done("length")
        await until(all_free(prefill), what="every block freed")
