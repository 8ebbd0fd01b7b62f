"""The tcp KV listener at its limits. Full, it picks the idlest stream under its lock and
shuts it after: a head read in that gap was claimed (blocks written, then the stream shut
mid-frame); now the reader sees it was picked and claims nothing, and the frame's transfer
is refused at once (its frame will never come). Out of file descriptors, it said so every
0.1 s; now once per 10 s, as for a full listener."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any

from pdserve.common.kv import tcp
from pdserve.common.kv.tcp import TcpListener
from pdserve.common.sampling import SamplingParams
from tests.component.cluster import until
from tests.component.test_kv_backends import Pair
from tests.component.test_tcp_stream import FRAME, Sink


class Recording(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.claims: list[str] = []
        self.lost: list[tuple[str, str]] = []

    def claim_frame(self, peer: str, request_id: str, layer: int, nbytes: int) -> Any:
        self.claims.append(request_id)
        return super().claim_frame(peer, request_id, layer, nbytes)

    async def frame_lost(self, peer: str, request_id: str) -> None:
        self.lost.append((peer, request_id))


async def test_a_head_read_on_a_stream_picked_to_be_shut_claims_nothing(monkeypatch) -> None:
    picked: list[socket.socket] = []
    real_shut = tcp.shut
    monkeypatch.setattr(tcp, "shut", picked.append)  # the gap after the pick, held open
    sink = Recording()
    listener = TcpListener("127.0.0.1", timeout=10.0)
    listener.start(sink)
    raw = socket.create_connection(("127.0.0.1", int(listener.address.rpartition(":")[2])))
    try:
        raw.sendall(b"p".ljust(tcp.ID_BYTES))
        await until(lambda: "p" in listener.conns and not listener.unproven, what="proven")
        conn = listener.conns["p"]
        assert listener._shut_idlest() and picked == [conn]  # picked, not shut yet
        raw.sendall(tcp.frame_head("big", 0, FRAME) + b"\0" * 1024)  # then a frame begins
        await until(lambda: sink.claims or sink.lost, what="the reader's decision")
        assert sink.claims == [] and sink.lost == [("p", "big")]
    finally:
        for c in picked:
            real_shut(c)
        raw.close()
        await listener.close()


async def test_a_frame_lost_with_its_stream_refuses_its_transfer_and_frees_its_blocks():
    pair = await Pair("tcp", capacity=600).start()
    total = len(pair.free)
    try:
        t = pair.sender.begin("gone", pair.target, list(range(40)), 40, SamplingParams(), [0, 1, 2])
        await until(lambda: "gone" in pair.intake.incoming, what="the header")
        await pair.intake.landing.frame_lost("other", "gone")  # not its sender: nothing
        assert "gone" in pair.intake.incoming and len(pair.free) < total
        await pair.intake.landing.frame_lost("p", "gone")
        await until(lambda: pair.refusals == ["KV stream failed"], what="refused")
        assert len(pair.free) == total and "gone" not in pair.intake.incoming
        pair.sender.release(t.request_id)
    finally:
        await pair.close()


async def test_accept_failures_are_said_once_per_ten_seconds(monkeypatch, caplog) -> None:
    failed = 0

    async def no_descriptors(sock: socket.socket) -> Any:
        nonlocal failed
        failed += 1
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(asyncio.get_running_loop(), "sock_accept", no_descriptors)
    listener = TcpListener("127.0.0.1", timeout=10.0)
    with caplog.at_level(logging.WARNING, logger=tcp.__name__):
        listener.start(Recording())
        try:
            await until(lambda: failed >= 4, what="four failed accepts")  # 0.1 s apart
        finally:
            await listener.close()
    said = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
