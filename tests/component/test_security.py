"""--cluster-key: key files, CurveZMQ on the socket factory's sockets, and the tcp KV stream's
challenge. A peer with the key gets through byte-exact; one without it (plain ZeroMQ, another
key, a raw connection) gets nothing through and is logged."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat

import pytest
import zmq

from pdserve.common.wire import security
from pdserve.common.wire.security import (
    BadKey,
    ClusterKey,
    close_context,
    make_context,
    watch_handshakes,
)
from pdserve.common.wire.transport import bound_address, make_socket
from tests.component.test_kv_backends import BLOCK, Pair, digest


def test_key_files_round_trip_private_and_checked(tmp_path):
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ClusterKey.load(path) == key
    other = ClusterKey.generate()
    bad = tmp_path / "mixed.key"
    bad.write_text(f"public = {other.public.decode()}\nsecret = {key.secret.decode()}\n")
    with pytest.raises(BadKey, match="does not belong"):
        ClusterKey.load(bad)
    with pytest.raises(BadKey):
        ClusterKey.load(tmp_path / "missing.key")
    not_z85 = tmp_path / "not-z85.key"  # 40 characters, some outside Z85: a ZMQError before
    not_z85.write_text(f"public = {key.public.decode()}\nsecret = {'~' * 40}\n")
    with pytest.raises(BadKey, match="Z85"):
        ClusterKey.load(not_z85)
    assert key.check(key.mac(b"nonce", b"id"), b"nonce", b"id")
    assert not other.check(key.mac(b"nonce", b"id"), b"nonce", b"id")


def test_a_key_file_is_written_private_even_over_another_and_never_said(tmp_path):
    """keygen over an existing 0644 file left the new secret world-readable (the mode is
    applied to new files only) and followed a symlink at the path; a key file with a byte
    that is not UTF-8 put the file's bytes, the secret among them, into the error."""
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    path.write_text("old")
    path.chmod(0o644)
    key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and ClusterKey.load(path) == key
    target, link = tmp_path / "target", tmp_path / "link.key"
    target.write_text("keep")
    link.symlink_to(target)
    with pytest.raises(OSError):
        key.save(link)
    assert target.read_text() == "keep"
    odd = tmp_path / "odd.key"
    odd.write_bytes(path.read_bytes() + b"\xff")
    with pytest.raises(BadKey) as err:
        ClusterKey.load(odd)
    assert key.secret.decode() not in str(err.value) and "UnicodeDecodeError" in str(err.value)


async def _received(server: zmq.asyncio.Socket, timeout: float) -> list[bytes] | None:
    with contextlib.suppress(asyncio.TimeoutError):
        return await asyncio.wait_for(server.recv_multipart(), timeout)
    return None


async def test_curve_admits_the_cluster_key_only_and_logs_the_rest(caplog, monkeypatch):
    # the log says a reason once per 10 s per process: an earlier test in this worker that
    # was refused (tests/component/test_precheck.py) must not have said it for this one
    monkeypatch.setattr(security.REFUSALS, "last", {})
    key = ClusterKey.generate()
    server_ctx = make_context(key)
    server = make_socket(server_ctx, "node.data", "tcp://127.0.0.1:0")
    address = bound_address(server, "127.0.0.1")
    watcher = asyncio.create_task(watch_handshakes(server, "node.data"))
    contexts = {
        "member": make_context(key),
        "no key": make_context(None),
        "other key": make_context(ClusterKey.generate()),
    }
    before = security.REFUSALS.count
    try:
        got = {}
        for name, ctx in contexts.items():
            client = make_socket(ctx, "node.data_out", address, identity=name)
            await client.send(b"hello from " + name.encode())
            # the member's handshake and message may take a loaded host a while; a stranger's
            # refusal is known from REFUSALS, the second only bounds the wait for nothing
            got[name] = await _received(server, 10.0 if name == "member" else 1.0)
        assert got["member"] == [b"member", b"hello from member"]
        assert got["no key"] is None and got["other key"] is None
        assert security.REFUSALS.count >= before + 2  # both strangers were seen and refused
        assert "refused an unauthenticated peer" in caplog.text
    finally:
        watcher.cancel()
        for ctx in contexts.values():
            close_context(ctx)
        close_context(server_ctx)


@pytest.mark.parametrize("backend", ["tcp", "zmq"])
async def test_kv_moves_byte_exact_with_a_cluster_key(backend):
    pair = await Pair(backend, capacity=600, key=ClusterKey.generate()).start()  # 37 blocks
    try:
        for i, n in enumerate([1, 17, 257]):
            table = list(range(i * 10, i * 10 + 17))[: -(-n // BLOCK)]
            intake = await pair.send(f"r{i}", n, table, layerwise=i % 2 == 0)
            assert intake.header.backend == backend
            assert digest(pair.dst, intake.block_table, n) == digest(pair.src, table, n)
            pair.release(intake.block_table)
    finally:
        await pair.close()


async def test_a_tcp_kv_connection_without_the_key_is_closed_unread(caplog):
    pair = await Pair("tcp", capacity=600, key=ClusterKey.generate()).start()
    host, port = pair.tcp_address.rsplit(":", 1)
    before = security.REFUSALS.counts["kv-stream"]
    try:
        loop = asyncio.get_running_loop()
        for mac in (b"\0" * security.MAC_BYTES, ClusterKey.generate().mac(b"x")):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.setblocking(False)
            nonce = await loop.sock_recv(sock, security.NONCE_BYTES)  # the challenge comes first
            assert len(nonce) == security.NONCE_BYTES
            await loop.sock_sendall(sock, b"p".ljust(64) + mac)
            assert await asyncio.wait_for(loop.sock_recv(sock, 10), 5) == b""  # closed
            sock.close()
        assert security.REFUSALS.counts["kv-stream"] == before + 2  # pdserve:refused_peers
        # the member still gets through afterwards
        intake = await pair.send("after", 40, [0, 1, 2], layerwise=False)
        assert digest(pair.dst, intake.block_table, 40) == digest(pair.src, [0, 1, 2], 40)
    finally:
        await pair.close()
