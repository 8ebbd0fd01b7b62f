"""Several gateways, the pure parts: which gateways a node is given, how it tracks whose
request is whose, `pdserve up --gateways N`, the supervisor's rule for them, and which
gateway leads pool care."""

from __future__ import annotations

import socket

import zmq.asyncio

from pdserve import launch
from pdserve.common.config import NodeConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.flags import from_args
from pdserve.common.node.adoption import Adoption
from pdserve.common.node.gateways import Gateways
from pdserve.common.node.links import GatewayLink, Owners, gateway_addresses
from pdserve.common.node.role import NodeRequest
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Adopt, Load, NodeInfo
from pdserve.gateway.cluster import ClusterView
from pdserve.supervisor import Child, Supervisor
from tests.unit.test_config_file import parse, write
from tests.unit.test_supervisor import FakeProc


def test_gateway_addresses_split_deduplicate_and_expand_names_of_several(monkeypatch):
    given = "tcp://127.0.0.1:8001, tcp://localhost:8011,tcp://127.0.0.1:8001,ipc:///tmp/gw"
    assert gateway_addresses(given) == ["tcp://127.0.0.1:8001", "tcp://localhost:8011",
                                        "ipc:///tmp/gw"]  # fmt: skip

    def resolve(host, port, *args, **kwargs):  # a headless Service: one address per pod
        assert host == "gateway"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in ("10.0.0.7", "10.0.0.5", "10.0.0.7")]  # fmt: skip

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert gateway_addresses("tcp://gateway:8001") == ["tcp://10.0.0.5:8001",
                                                       "tcp://10.0.0.7:8001"]  # fmt: skip

    def one(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port))]

    monkeypatch.setattr(socket, "getaddrinfo", one)  # one gateway: its address
    assert gateway_addresses("tcp://gateway:8001") == ["tcp://10.0.0.9:8001"]

    def none(host, port, *args, **kwargs):
        raise socket.gaierror("not yet")

    monkeypatch.setattr(socket, "getaddrinfo", none)  # nothing yet: ZeroMQ tries the name
    assert gateway_addresses("tcp://gateway:8001") == ["tcp://gateway:8001"]

    def one_of_two(host, port, *args, **kwargs):  # a stopped compose gateway: no address
        if host == "gateway":
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.8", port))]

    # given to ZeroMQ, the name held up every socket of the node while libzmq looked it up at
    # each reconnect: left to the discovery loop when another gateway resolves
    monkeypatch.setattr(socket, "getaddrinfo", one_of_two)
    assert gateway_addresses("tcp://gateway:8001,tcp://gateway-b:8001") == ["tcp://10.0.0.8:8001"]
    assert gateway_addresses("tcp://gateway:8001,ipc:///tmp/gw") == ["ipc:///tmp/gw"]


def test_owners_keep_a_request_one_sweep_after_the_node_lets_go():
    owners, a, b = Owners(), object(), object()
    assert owners.adopt("r1", a) and owners.adopt("r1", a)  # again by its own gateway: fine
    assert not owners.adopt("r1", b)  # another gateway may not take it
    owners.adopt("r2", b)
    owners.sweep(held={"r2"})  # r1 let go: still routed once more (a late record)
    assert owners.get("r1") is a
    owners.sweep(held={"r2"})
    assert owners.get("r1") is None and owners.get("r2") is b
    assert owners.owned(b) == ["r2"]


def test_node_gateway_flag_repeats_and_the_command_line_overrides_a_config_file(tmp_path):
    args = parse("decode", "--gateway", "tcp://a:1", "--gateway", "tcp://b:2")
    assert from_args(NodeConfig, args).gateway == "tcp://a:1,tcp://b:2"
    path = write(tmp_path, "gateway: [tcp://c:1, tcp://d:1]\n")
    from_file = parse("decode", "--config", path)
    assert from_args(NodeConfig, from_file).gateway == "tcp://c:1,tcp://d:1"
    both = parse("decode", "--config", path, "--gateway", "tcp://x:1")
    assert from_args(NodeConfig, both).gateway == "tcp://x:1"


def test_up_with_two_gateways_gives_each_its_ports_and_every_node_both():
    args = parse("up", "--engine", "sim", "--gateways", "2", "--port", "9000",
                 "--control-port", "9001", "--tokens-port", "9002")  # fmt: skip
    commands = launch.cluster_commands(args)
    gateways = [c for c in commands if "--node-id" not in c]
    ports = [(c[c.index("--port") + 1], c[c.index("--control-port") + 1]) for c in gateways]
    assert ports == [("9000", "9001"), ("9010", "9011")]
    nodes = [c for c in commands if "--node-id" in c]
    assert len(nodes) == 2
    for node in nodes:
        assert node[node.index("--gateway") + 1] == "tcp://127.0.0.1:9001,tcp://127.0.0.1:9011"


def test_the_cluster_runs_while_one_gateway_does():
    spawned: dict[str, list[FakeProc]] = {}

    def spawn(child: Child) -> FakeProc:
        spawned.setdefault(child.name, []).append(FakeProc())
        return spawned[child.name][-1]

    names = ("gateway-0", "gateway-1", "decode-0")
    sup = Supervisor([Child(n, [n], essential=n.startswith("gateway")) for n in names], spawn,
                     backoff=0.1, give_up_after=1)  # fmt: skip
    sup.start(0.0)
    spawned["gateway-0"][-1].code = 1  # fails fast: given up on
    assert sup.step(0.5)  # gateway-1 serves
    spawned["gateway-1"][-1].code = 1
    assert not sup.step(1.0)  # no gateway left


def _info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="decode", data_address="", host_id="h",
                    model_id="m", dtype="float32", tokenizer_fingerprint="t", kv_layout="l",
                    block_size=16, num_blocks=64, max_batch=8, max_batch_tokens=8192,
                    max_model_len=4096)  # fmt: skip


def test_a_gateway_leads_while_no_node_names_another():
    cluster = ClusterView(heartbeat_timeout=2.0)
    load = Load(running=0, waiting=0, blocks_free=64, blocks_cached=0, blocks_in_use=0)
    # no node: nothing to lead (cut off from every node, it exported desired replicas of
    # its own beside the leader's)
    assert not cluster.leads("gw-a")
    for n in ("d0", "d1"):
        assert cluster.register(_info(n), n.encode(), 0.0, "t") is None
    assert cluster.leads("gw-a") and cluster.leads("gw-b")  # nobody named yet: either may
    cluster.heartbeat("d0", b"d0", load, 1.0, leader="gw-a")
    assert cluster.leads("gw-a") and not cluster.leads("gw-b")
    cluster.heartbeat("d1", b"d1", load, 1.0, leader="gw-b")  # a new gateway, seen by one
    assert not cluster.leads("gw-a") and not cluster.leads("gw-b")  # nobody until they agree


class _Node:
    """What Adoption asks of a node: the requests it holds, and freeing some."""

    def __init__(self, *rids: str) -> None:
        self.requests: dict = dict.fromkeys(rids)
        self.freed: list[str] = []
        self.unparked: list[str] = []

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        self.freed += request_ids
        for rid in request_ids:
            self.requests.pop(rid, None)

    def abort(self, rid: str) -> None:
        self.free_stale((rid,))

    def unpark(self, rid: str) -> None:
        self.unparked.append(rid)

    def adopted(self, rid: str) -> None:
        pass

    def load(self) -> Load:
        return Load(running=len(self.requests), waiting=0, blocks_free=0, blocks_cached=0,
                    blocks_in_use=0, held=tuple(self.requests))  # fmt: skip


def test_a_released_stream_waits_for_an_adopter_until_the_grace_ends():
    """A gateway lets go of a stream whose client left (`Release`): the node keeps it as an
    orphan. No gateway's lease frees it (a late stale reply, or the one gateway's heartbeat,
    which no longer names it), any gateway may adopt it, and the grace frees it."""
    ctx = zmq.asyncio.Context()
    try:
        own, other = (GatewayLink(ctx, f"tcp://127.0.0.1:{p}", "node-x") for p in (9, 10))
        own.registered = other.registered = True  # their RegisterAcks read
        own.gateway_id, other.gateway_id = "g-own", "g-other"
        node = _Node("r.0", "s.0")
        gateways = Gateways("node-x", [own], node)  # type: ignore[arg-type]
        for rid in node.requests:
            assert gateways.owners.adopt(rid, own)
        adoption = Adoption(gateways, node, grace=3.0)
        adoption.release("s.0", other, 100.0)  # not the other gateway's to let go
        assert gateways.owners.get("s.0") is own
        adoption.release("r.0", own, 100.0)
        assert gateways.owners.orphan("r.0") and not gateways.leased_by("r.0", own)
        assert gateways.leased_by("s.0", own)
        beat = gateways.heartbeat(own, node.load(), None, 0, reply=False)
        assert beat.load.held == ("s.0",)  # the orphan is no longer its
        adoption.expire(102.9)
        assert node.freed == [] and gateways.gone
        adoption.expire(103.1)
        assert node.freed == ["r.0"] and not gateways.gone
    finally:
        own.close()
        other.close()
        ctx.term()


def test_a_stream_that_ended_before_its_release_came_is_kept_for_a_resume():
    """The client left in the very step its request ended: the node had sent the last tokens
    to the gateway that let it go, and reads the `Release` after. It keeps the ended stream
    (every token) as an orphan through any number of sweeps, adoptable by any gateway, until
    the grace ends; an ended request nobody let go, or another gateway's, is not kept."""
    ctx = zmq.asyncio.Context()
    try:
        own, other = (GatewayLink(ctx, f"tcp://127.0.0.1:{p}", "node-x") for p in (9, 10))
        own.registered = other.registered = True  # their RegisterAcks read
        own.gateway_id, other.gateway_id = "g-own", "g-other"
        node = _Node("r.0", "s.0")
        gateways = Gateways("node-x", [own, other], node)  # type: ignore[arg-type]
        for rid in node.requests:
            assert gateways.owners.adopt(rid, own)
        adoption = Adoption(gateways, node, grace=3.0)
        params = SamplingParams(max_tokens=3, temperature=0.0)
        for rid in ("r.0", "s.0"):  # both end for a live gateway
            seq = Sequence.new(rid, [5, 6, 7], params)
            seq.token_ids += [8, 9, 10]
            del node.requests[rid]
            adoption.ended(NodeRequest(seq=seq), "length", 100.0)
        assert not adoption.finished  # nobody let them go
        adoption.release("s.0", other, 100.1)  # not the other gateway's to let go
        assert not adoption.finished
        adoption.release("r.0", own, 100.1)
        adoption.release("s.0", own, 100.1)
        assert sorted(adoption.finished) == ["r.0", "s.0"] and gateways.owners.orphan("r.0")
        for _ in range(3):  # heartbeats: the ended orphans' owners are not forgotten
            adoption.sweep(node.load().held)
        adoption.expire(103.0)  # within the grace
        answers = adoption.adopt(Adopt(streams=[("r", 2)]), other)
        assert [(w, a.found, a.output_ids, a.finish_reason) for w, a in answers] == [
            ("r.0", True, [8, 9, 10], "length")
        ]
        assert list(adoption.finished) == ["s.0"]  # the adopter has every token of r
        adoption.expire(103.2)  # the grace is over: the one never adopted is let go too
        assert not adoption.finished
    finally:
        own.close()
        other.close()
        ctx.term()


def test_what_ended_as_its_gateway_died_is_kept_for_a_resume():
    """A gateway dies; the node sees it only at its heartbeat timeout. Requests of that
    gateway that ended meanwhile sent their last tokens to a dead process: once the node
    sees the silence they are ended orphans, adoptable by another gateway, freed at the
    grace's end. What ended long before, or for another gateway, is not kept."""
    ctx = zmq.asyncio.Context()
    try:
        own, other = (GatewayLink(ctx, f"tcp://127.0.0.1:{p}", "node-x") for p in (9, 10))
        own.registered = other.registered = True  # their RegisterAcks read
        own.gateway_id, other.gateway_id = "g-own", "g-other"
        ends = {"old.0": 90.0, "r.0": 99.5, "t.0": 99.8, "u.0": 99.9}  # u.0 is the other's
        node = _Node(*ends)
        gateways = Gateways("node-x", [own, other], node)  # type: ignore[arg-type]
        for rid in ends:
            assert gateways.owners.adopt(rid, other if rid == "u.0" else own)
        adoption = Adoption(gateways, node, grace=3.0, heartbeat_timeout=1.0)  # kept 5 s
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for rid, at in ends.items():
            seq = Sequence.new(rid, [5, 6], params)
            seq.token_ids += [7, 8]
            del node.requests[rid]
            adoption.ended(NodeRequest(seq=seq), "length", at)
        own.silent_since = 100.2  # 0.7 s after r.0 ended: its gateway's heartbeat timeout
        adoption.silenced(own)
        assert sorted(adoption.finished) == ["r.0", "t.0"]
        for _ in range(3):
            adoption.sweep(node.load().held)
        answers = adoption.adopt(Adopt(streams=[("r", 1), ("old", 0), ("u", 0)]), other)
        assert [(w, a.found, a.output_ids) for w, a in answers] == [("r.0", True, [7, 8])]
        adoption.expire(103.1)  # within the grace of the silence
        assert list(adoption.finished) == ["t.0"]
        adoption.expire(103.3)
        assert not adoption.finished
    finally:
        own.close()
        other.close()
        ctx.term()


class _Stepping(_Node):
    """A node whose requests are in a running step: freeing one waits for the step's end."""

    def free_stale(self, request_ids: tuple[str, ...]) -> None:
        self.freed += request_ids


def test_an_orphan_freed_at_the_grace_is_no_orphan_while_its_step_ends():
    """The grace ended for a running orphan: its abort waits for the engine's step. A resume
    that came meanwhile was handed the stream (found, owner moved to its gateway), then the
    step dropped it without a word: the adopter's client waited for tokens that never came."""
    ctx = zmq.asyncio.Context()
    try:
        own, other = (GatewayLink(ctx, f"tcp://127.0.0.1:{p}", "node-x") for p in (9, 10))
        own.registered = other.registered = True  # their RegisterAcks read
        own.gateway_id, other.gateway_id = "g-own", "g-other"
        seq = Sequence.new("r.0", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.0))
        seq.token_ids += [8, 9]
        node = _Stepping()
        node.requests["r.0"] = NodeRequest(seq=seq)
        gateways = Gateways("node-x", [own, other], node)  # type: ignore[arg-type]
        assert gateways.owners.adopt("r.0", own)
        adoption = Adoption(gateways, node, grace=3.0)
        adoption.release("r.0", own, 100.0)
        assert adoption.adopt(Adopt(streams=[("r", 0)]), own)[0][1].found  # within the grace
        assert node.unparked == ["r.0"]  # decodes here (were it parked for a dead leader)
        # asked again (its answer lost): its adopter may have parked it since, to move it
        assert adoption.adopt(Adopt(streams=[("r", 0)]), own)[0][1].found
        assert node.unparked == ["r.0"]
        adoption.release("r.0", own, 100.5)
        adoption.expire(103.6)
        assert node.freed == ["r.0"] and "r.0" in node.requests  # its step still runs
        assert not gateways.owners.orphan("r.0")
        answers = adoption.adopt(Adopt(streams=[("r", 0)]), other)
        assert [(w, a.found) for w, a in answers] == [("r.0", False)]
        adoption.expire(110.0)  # and not freed (or counted) a second time
        assert node.freed == ["r.0"]
    finally:
        own.close()
        other.close()
        ctx.term()


def test_the_oldest_gateway_has_the_lowest_id():
    """Nodes take pool care from the lowest id they know: a gateway that starts later (a
    rolling update, a restart) must not take the lead with rates that start from nothing."""
    import time

    from pdserve.gateway.link import new_gateway_id

    ids = []
    for _ in range(3):
        ids.append(new_gateway_id())
        time.sleep(0.001)
    assert ids == sorted(ids) and len(set(ids)) == 3
