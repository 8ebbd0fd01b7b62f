"""The one-copy same-host path (shm_direct): the prefill side writes each layer straight into
the decode node's shared cache under a write grant. Hundreds of transfers in flight at once
land byte-exact; a grant is never revoked under a writer (the blocks wait), a revoked grant
writes nothing, and a writer that dies inside its grant does not pin the blocks."""

from __future__ import annotations

import asyncio
import os
import random
import time

import torch

from pdserve.common.engine.shared_kv import PREFIX, SHM_DIR, map_cache
from pdserve.common.kv.grants import GrantTable, GrantView
from pdserve.common.ofd import sweep_dead_kv_files
from pdserve.common.sampling import SamplingParams
from tests.component.cluster import until
from tests.component.test_kv_backends import BLOCK, LAYOUT, Pair, digest


async def test_two_hundred_transfers_in_flight_land_byte_exact_and_free_every_grant():
    pair = await Pair("shm_direct", capacity=6400).start()
    rng = random.Random(7)
    try:
        sizes = [rng.randint(1, 40) for _ in range(200)]
        tables, spot = [], 0
        for n in sizes:  # source blocks spread over the prefill cache
            tables.append([(spot + b) % 380 for b in range(-(-n // BLOCK))])
            spot += 3
        transfers = []
        for i, n in enumerate(sizes):  # all headers out before any layer
            t = pair.sender.begin(f"r{i}", pair.target, list(range(n)), n, SamplingParams(),
                                  tables[i])  # fmt: skip
            transfers.append(t)
        for layer in range(LAYOUT.num_layers):  # layer-wise, interleaved across requests
            for t in transfers:
                pair.sender.push(t, layer, pair.sender.stage(t, layer))
        for t in transfers:
            pair.sender.done(t, 1)
        landed = {}
        for _ in sizes:
            intake = await asyncio.wait_for(pair.admitted.get(), 30)
            landed[intake.header.request_id] = intake
        for i, n in enumerate(sizes):
            intake = landed[f"r{i}"]
            assert intake.header.backend == "shm_direct"
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, tables[i], n), i
        grants = pair.receivers["shm_direct"].grants  # type: ignore[attr-defined]
        await until(lambda: not pair.sender.transfers, 5.0, "every transfer ended")
        assert grants.outstanding == 0 and not pair.sender.transfers
    finally:
        await pair.close()


async def test_blocks_wait_for_a_writer_inside_its_grant_and_a_revoked_grant_writes_nothing():
    pair = await Pair("shm_direct", capacity=600).start()
    pair.free = pair.free[:8]
    total = len(pair.free)
    try:
        t = pair.sender.begin("slow", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        pair.sender.push(t, 0, pair.sender.stage(t, 0))
        state = t.state
        grant = await asyncio.wait_for(asyncio.shield(state.granted), 5)
        assert grant is not None and len(pair.free) == total - 3
        before = pair.dst.cache.data.clone()
        view = GrantView(pair.receivers["shm_direct"].grants.path)  # type: ignore[attr-defined]
        with view.hold(grant.ticket, grant.nonce) as valid:  # a writer mid-copy
            assert valid
            pair.intake.drop("slow")  # the decode side gives up on the transfer
            await pair.intake.expire(time.monotonic())
            assert len(pair.free) == total - 3  # quarantined: the writer is inside
        await pair.intake.expire(time.monotonic())
        assert len(pair.free) == total  # the writer left: the grant is revoked, blocks back
        sender = pair.sender.connector("shm_direct")
        wrote = sender._write(t, state, grant, 1, None)  # type: ignore[attr-defined]
        assert wrote is False  # the revoked grant copies nothing
        changed = (pair.dst.cache.data != before).flatten(1).any(dim=1)
        assert not changed[1:].any()  # layer 1 and on untouched (layer 0 landed before)
        del view
        pair.sender.release("slow")
        ok = await pair.send("after", 20, [5, 6], layerwise=True)
        assert digest(pair.dst, ok.block_table, 20) == digest(pair.src, [5, 6], 20)
    finally:
        await pair.close()


def test_a_writer_that_dies_inside_its_grant_does_not_pin_the_blocks():
    table = GrantTable(4)
    ticket, nonce = table.grant()  # type: ignore[misc]
    pid = os.fork()
    if pid == 0:  # the writer: takes the grant's lock and dies holding it
        with GrantView(table.path).hold(ticket, nonce):
            os.kill(os.getpid(), 9)
    os.waitpid(pid, 0)
    assert table.revoke(ticket)  # the kernel dropped the dead writer's lock
    with GrantView(table.path).hold(ticket, nonce) as valid:
        assert not valid
    table.close()
    assert not os.path.exists(table.path)


def test_a_killed_decode_node_s_grant_file_is_swept_and_a_live_one_kept():
    # a grant file's owner holds the byte after its slots (the slots' bytes are the writers');
    # a decode node SIGKILLed leaves its file, which the next sweep removes
    live = GrantTable(4)
    view = GrantView(live.path)  # a writer's view of it, this process's other open
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the decode node: makes its table, says where, dies without closing it
        os.write(write, GrantTable(4).path.encode())
        os.kill(os.getpid(), 9)
    os.close(write)
    dead = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert os.path.exists(dead)
    assert sweep_dead_kv_files() >= 1
    assert not os.path.exists(dead) and os.path.exists(live.path)
    ticket, nonce = live.grant()  # type: ignore[misc]
    with view.hold(ticket, nonce) as valid:  # a writer inside: the file is its owner's
        sweep_dead_kv_files()
        assert valid and os.path.exists(live.path)
    live.close()
    assert not os.path.exists(live.path)


def test_an_orphaned_cache_file_is_swept_and_a_live_one_kept():
    from benchmarks.cache_engine import CacheOnlyEngine

    live = CacheOnlyEngine(LAYOUT, 64, BLOCK, torch.float32, shared=True)
    path = live.cache.shared.path  # type: ignore[union-attr]
    orphan = os.path.join(SHM_DIR, PREFIX + "deadbeef0000")
    with open(orphan, "wb") as f:  # a file no live owner locks (its node was SIGKILLed)
        f.write(b"\0" * 4096)
    assert sweep_dead_kv_files() >= 1
    assert not os.path.exists(orphan) and os.path.exists(path)
    peer = map_cache(path, tuple(live.cache.data.shape), torch.float32)  # a writer's view
    peer[3, 1, 5].fill_(2.5)
    assert torch.equal(live.cache.data[3, 1, 5], peer[3, 1, 5])  # one memory
    del live
    assert not os.path.exists(path)  # the file goes with its cache


def test_a_shared_cache_with_no_room_left_in_dev_shm_is_a_private_one(monkeypatch):
    """Two nodes starting together both see room in /dev/shm for their cache; the second
    to fill it got a SIGBUS while zeroing its pages (the node died). Its pages are reserved
    first: no room is an error there, and the cache is a private one (peers send to it
    another way), its draft file gone."""
    from benchmarks.cache_engine import CacheOnlyEngine

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir(SHM_DIR))
    engine = CacheOnlyEngine(LAYOUT, 64, BLOCK, torch.float32, shared=True)
    assert engine.cache.shared is None and engine.cache.data.abs().sum() == 0
    assert set(os.listdir(SHM_DIR)) <= before


def test_malformed_or_stale_endpoints_are_not_usable_and_fall_back():
    from benchmarks.cache_engine import CacheOnlyEngine
    from pdserve.common.kv import backend, choose
    from pdserve.common.kv.base import Local
    from pdserve.common.node import host_identity

    own = CacheOnlyEngine(LAYOUT, 64, BLOCK, torch.float32)
    me = Local("p", host_identity(), "127.0.0.1", own.kv_store)  # type: ignore[arg-type]
    senders = {name: backend(name).send(me) for name in ("shm_direct", "cuda_ipc", "shm")}
    layout = ",".join(str(x) for x in own.cache.layout)
    host = host_identity()
    bad = [
        "", "|||", f"{host}|/etc/passwd|/dev/shm/pdserve-grants-x|{layout}",
        f"{host}|/dev/shm/pdserve-kv-gone|/dev/shm/pdserve-grants-gone|{layout}",
        f"{host}|/dev/shm/pdserve-kv-x|/dev/shm/pdserve-grants-x|1,2,3",
        f"other-host|/dev/shm/pdserve-kv-x|/dev/shm/pdserve-grants-x|{layout}",
        f"{host}|not-json:@@@|/dev/shm/pdserve-grants-x|{layout}",
    ]  # fmt: skip
    for endpoint in bad:
        assert not senders["shm_direct"].usable(endpoint), endpoint
        assert not senders["cuda_ipc"].usable(endpoint), endpoint  # no CUDA cache here
        picked = choose(
            "auto",
            lambda b, ep: senders[b].usable(ep),
            {"shm_direct": endpoint, "shm": host, "zmq": "tcp://x:1"},
        )  # fmt: skip
        assert picked == "shm"  # the next backend on this host


async def test_a_lost_grant_fails_its_transfer_once_not_once_per_layer():
    pair = await Pair("shm_direct", capacity=600).start()
    receiver = pair.receivers["shm_direct"]
    try:
        pair.sender.local.timeout = 0.5
        real = receiver.grant
        receiver.grant = lambda rec, table: None  # type: ignore[method-assign]  # lost
        t = pair.sender.begin("lost", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        started = time.monotonic()
        pair.sender.push_all(t, pair.sender.stage_all(t))
        receiver.grant = real  # type: ignore[method-assign]
        ok = await pair.send("next", 20, [5, 6], layerwise=True)  # queued behind all 30 layers
        assert time.monotonic() - started < 5  # one timeout, not 30 of them
        assert digest(pair.dst, ok.block_table, 20) == digest(pair.src, [5, 6], 20)
        pair.sender.release("lost")
    finally:
        await pair.close()


def test_revoking_closes_a_grant_at_once_even_while_a_writer_is_inside():
    table = GrantTable(4)
    ticket, nonce = table.grant()  # type: ignore[misc]
    view = GrantView(table.path)
    with view.hold(ticket, nonce) as valid:
        assert valid
        assert not table.revoke(ticket)  # the writer is inside: not confirmed yet
    with view.hold(ticket, nonce) as valid:
        assert not valid  # but no later layer passes the check
    assert table.revoke(ticket) and table.outstanding == 0
    second = table.grant()
    assert second is not None and second[0] != ticket  # FIFO: a ticket rests before reuse
    assert table.close(wait=0.1) == 0  # every ticket revoked, the file removed
    assert not os.path.exists(table.path)


async def test_forged_grants_write_nothing_and_the_channel_goes_on():
    """A KvGrant is input from another process: one for an unknown request is ignored, and
    one with a wrong nonce, blocks outside the cache or too few blocks copies nothing."""
    from pdserve.common.wire.kv_messages import (
        KvGrant,
    )

    pair = await Pair("shm_direct", capacity=600).start()
    try:
        t = pair.sender.begin("real", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        grant = await asyncio.wait_for(asyncio.shield(t.state.granted), 5)
        sender = pair.sender.connector("shm_direct")
        peer = next(iter(pair.sender.peers.values()))
        stray = KvGrant(request_id="nobody", ticket=0, nonce=1, block_table=[0])
        await pair.sender._on_reply(peer, stray)  # no such transfer: ignored
        before = pair.dst.cache.data.clone()
        forged = [
            KvGrant(request_id="real", ticket=grant.ticket, nonce=grant.nonce ^ 1,
                    block_table=grant.block_table),
            KvGrant(request_id="real", ticket=grant.ticket, nonce=grant.nonce,
                    block_table=[10**6, 0, 1]),
            KvGrant(request_id="real", ticket=grant.ticket, nonce=grant.nonce, block_table=[0]),
            KvGrant(request_id="real", ticket=10**9, nonce=grant.nonce,
                    block_table=grant.block_table),
        ]  # fmt: skip
        for bad in forged:
            assert sender._write(t, t.state, bad, 0, None) is False  # type: ignore[attr-defined]
        assert torch.equal(pair.dst.cache.data, before)
        pair.sender.push_all(t, pair.sender.stage_all(t))  # the real grant still works
        pair.sender.done(t, 1)
        intake = await asyncio.wait_for(pair.admitted.get(), 10)
        assert digest(pair.dst, intake.block_table, 40) == digest(pair.src, [0, 1, 2], 40)
    finally:
        await pair.close()


async def test_a_mapping_of_a_cache_whose_file_is_gone_is_let_go():
    """A decode node restarted under a new id (outside Docker its id holds its pid): the
    writer kept mapping its old cache, an unlinked file whose memory stayed in /dev/shm, up to
    64 of them (new nodes then found no room for their caches)."""
    old, new = await Pair("shm_direct", 64).start(), await Pair("shm_direct", 64).start()
    try:
        writer = old.sender.connector("shm_direct")
        first, second = (p.target.kv_endpoints["shm_direct"] for p in (old, new))
        assert writer.usable(first) and writer.usable(second) and first in writer.peers
        os.unlink(old.dst.cache.shared.path)  # the node is gone, its file with it
        writer.swept = 0.0  # (a sweep a second at most)
        # a peer mapped already: the sweep ran on a new mapping only, and the gone node's
        # successor, short of /dev/shm, kept its cache private: no new mapping ever came
        assert writer.usable(second)
        assert first not in writer.peers and second in writer.peers
    finally:
        await old.close()
        await new.close()
