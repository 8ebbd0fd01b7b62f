"""A decode node's intake against what any peer reaching its sockets can cause: a first
token outside the model's vocabulary is refused before it could fail an engine step (the
embedding lookup of the next one; the node stopped, every request of the batch with it),
and a connection the tcp listener has no thread for is closed, the listener serving on."""

from __future__ import annotations

import asyncio
import socket

from pdserve.common.kv import tcp
from pdserve.common.sampling import SamplingParams
from tests.component.cluster import until
from tests.component.test_kv_backends import Pair, digest


async def test_a_first_token_outside_the_vocabulary_is_refused_and_its_blocks_freed():
    pair = await Pair("zmq", capacity=600).start()
    pair.intake.vocab_size = 1000
    total = len(pair.free)
    try:
        n, table = 40, [0, 1, 2]
        for token in (1000, -1, 10**12):
            t = pair.sender.begin(f"bad{token}", pair.target, list(range(n)), n,
                                  SamplingParams(), table)  # fmt: skip
            pair.sender.push_all(t, pair.sender.stage_all(t))
            pair.sender.done(t, token)
            told = len(pair.refusals) + 1  # the refusal back at the sender, then let go
            await until(lambda n=told: len(pair.refusals) >= n, 5.0, "refused")
            pair.sender.release(t.request_id)
        assert pair.refusals == [f"first token {t} is not in the vocabulary"
                                 for t in (1000, -1, 10**12)]  # fmt: skip
        assert pair.admitted.empty() and len(pair.free) == total
        ok = await pair.send("ok", n, table, layerwise=False)  # 1: inside it
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, table, n)
    finally:
        await pair.close()


async def test_the_tcp_listener_survives_having_no_thread_for_a_connection(monkeypatch):
    """A connection the listener cannot start a reader for (no thread to be had: a flood,
    a container's pids limit) is closed, and the listener goes on; the exception ended its
    accept loop, the node still advertising a tcp endpoint nobody served."""
    pair = await Pair("tcp", capacity=600).start()
    real = tcp.threading.Thread
    refused = {"n": 0}

    class NoThread(real):  # type: ignore[valid-type, misc]
        def start(self) -> None:
            if self.name.startswith("kv-tcp-in") and refused["n"] == 0:
                refused["n"] += 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(tcp.threading, "Thread", NoThread)
    try:
        host, port = pair.tcp_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            assert await asyncio.to_thread(raw.recv, 1) == b""  # closed by the listener
        assert refused["n"] == 1 and pair.intake.receivers["tcp"].listener.readers == 0
        n, table = 40, [0, 1, 2]
        ok = await pair.send("after", n, table, layerwise=True)
        assert digest(pair.dst, ok.block_table, n) == digest(pair.src, table, n)
    finally:
        monkeypatch.setattr(tcp.threading, "Thread", real)
        await pair.close()
