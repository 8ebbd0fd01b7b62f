"""KV transfer throughput: the KV of one 4,000-token Llama-3.1-8B request (fp16, 524 MB), from a
prefill process's paged cache into a decode process's paged cache, through pdserve's own
sender and intake (common/kv), per backend.

Each figure is bytes / time from the prefill side starting to send until the decode side has
scattered the last layer into its cache and acknowledged it, beside a raw TCP loopback socket
and a memcpy of the same payload in the same run (decimal GB/s). Raw TCP twice: received
into one reused frame-sized buffer (`raw_tcp`, the reference the ratios are held to, which
stays in the CPU's caches), and `raw_tcp_spread`, into a buffer of the whole KV's size (each
byte in its own place, as a transfer into a paged cache must land: what memory costs).
`*_gb_s`: consecutive destination blocks, as a fresh allocation's; `*_fragmented_gb_s`: every
block apart, the receiver's worst case. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/kv_transfer.py [--tokens 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import zmq
import zmq.asyncio

from benchmarks.cache_engine import LLAMA_LAYOUT, CacheOnlyEngine
from pdserve.common.costmodel import MODELS
from pdserve.common.kv import listen_all, receivers_for
from pdserve.common.kv.base import Local
from pdserve.common.kv.intake import Intake, KvIntake
from pdserve.common.kv.sender import KvSender, Transfer
from pdserve.common.memtune import tune_malloc
from pdserve.common.node import host_identity
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import DecodeTarget
from pdserve.common.wire.transport import bound_address, free_port, make_socket

BLOCK = 16
LLAMA = MODELS["llama3.1-8b"]


def CacheEngine(num_tokens: int, shared: bool = False, device: str = "cpu") -> CacheOnlyEngine:
    return CacheOnlyEngine(LLAMA_LAYOUT, num_tokens, BLOCK, torch.float16, shared, device)


def kv_digest(engine: CacheOnlyEngine, block_table: list[int], n: int) -> str:
    """SHA-256 of the request's KV in logical order: equal iff the bytes arrived exactly."""
    digest = hashlib.sha256()
    for layer in range(LLAMA.num_layers):
        digest.update(engine.kv_store.export_frame(layer, block_table, n))
    return digest.hexdigest()


def table(num_tokens: int, layout: str) -> list[int]:
    """Block ids of the request on one side. "source": 0..n-1. "fresh": 1..n, other ids but
    consecutive, as a node's allocations are while its free blocks are (a fresh decode
    node's are). "fragmented": every block apart, reversed: the receiver's worst case."""
    blocks = list(range(-(-num_tokens // BLOCK)))
    if layout == "fragmented":
        return blocks[::-1]
    return [b + 1 for b in blocks] if layout == "fresh" else blocks


# -- decode process ---------------------------------------------------------------------------
def decode_main(
    num_tokens: int, backend: str, layout: str, ready: Any, digest_q: Any, device: str
) -> None:
    tune_malloc()
    asyncio.run(_decode(num_tokens, backend, layout, ready, digest_q, device))


async def _decode(
    num_tokens: int, backend: str, layout: str, ready: Any, digest_q: Any, device: str
) -> None:
    # shm_direct writes into a cache that lives in /dev/shm
    engine = CacheEngine(num_tokens, shared=backend == "shm_direct", device=device)
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, "node.data", "tcp://127.0.0.1:0", max_msg=1 << 31)
    dest = table(num_tokens, layout)

    checked = False

    async def admit(intake: Intake, first_token: int) -> None:
        nonlocal checked
        if not checked:  # the untimed warm-up transfer proves byte-exactness
            checked = True
            digest_q.put(kv_digest(engine, dest, num_tokens))

    address = bound_address(sock, "127.0.0.1")
    local = Local(
        "bench-decode",
        host_identity(),
        "127.0.0.1",
        engine.kv_store,
        data_address=address,
        forced="ucx" if backend == "ucx" else "auto",
    )
    receivers = receivers_for(local)
    intake = KvIntake(
        sock,
        engine.kv_store,
        lambda h: list(dest),
        lambda b: None,
        admit,
        receivers,
    )
    ready.put((address, await listen_all(receivers, intake.landing)))
    await intake.run()


# -- prefill side -----------------------------------------------------------------------------
async def transfer_once(
    sender: KvSender,
    target: DecodeTarget,
    n: int,
    src: list[int],
    acked: asyncio.Queue[Transfer],
    rid: str,
) -> float:
    params = SamplingParams(max_tokens=2)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    t = sender.begin(rid, target, list(range(n)), n, params, src)

    def export_layers() -> None:  # as the prefill node's engine thread does, layer by layer
        for layer in range(t.num_layers):
            loop.call_soon_threadsafe(sender.push, t, layer, sender.stage(t, layer))

    await loop.run_in_executor(None, export_layers)
    sender.done(t, 7)
    await acked.get()
    return time.monotonic() - start


async def run_backend(
    backend: str, n: int, repeats: int, engine: CacheOnlyEngine, layout: str, device: str
) -> tuple[float, str]:
    ready: Any = mp.Queue()
    digest_q: Any = mp.Queue()
    args = (n, backend, layout, ready, digest_q, device)
    proc = mp.Process(target=decode_main, args=args, daemon=True)
    proc.start()
    address, endpoints = ready.get(timeout=120)
    ctx = zmq.asyncio.Context()
    acked: asyncio.Queue[Transfer] = asyncio.Queue()

    async def on_refuse(rid: str, peer: str, why: str) -> None:
        raise RuntimeError(f"refused: {why}")

    local = Local("bench-prefill", host_identity(), "127.0.0.1", engine.kv_store, forced=backend)
    sender = KvSender(ctx, local, on_ack=acked.put_nowait, on_refuse=on_refuse)
    target = DecodeTarget(
        node_id="bench-decode",
        data_address=address,
        host_id=host_identity(),
        kv_endpoints=endpoints,
    )
    src = table(n, "source")
    times = [
        await transfer_once(sender, target, n, src, acked, f"r{i}") for i in range(repeats + 1)
    ]
    received = digest_q.get(timeout=60)
    await sender.close()
    proc.terminate()
    proc.join()
    return statistics.median(times[1:]), received  # the first run warms pages and connections


def tcp_server(port: int, size: int, total: int, rounds: int, ready: Any, spread: bool) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(1)
    ready.put(1)
    conn, _ = s.accept()
    # reused (one frame's size: it stays in the CPU's caches), or `spread`: the whole KV's
    # size, each byte landing in its own place, as a cache-to-cache transfer's must
    buf = memoryview(bytearray(total if spread else size))
    if spread:
        buf[:] = bytes(total)  # its pages mapped before the clock starts, as a cache's are
    for _ in range(rounds):
        got = 0
        while got < total:
            at = got if spread else 0
            got += conn.recv_into(buf[at:], min(size, total - got))
        conn.sendall(b"k")


def raw_tcp_seconds(frames: list[memoryview], repeats: int, spread: bool = False) -> float:
    total = sum(len(f) for f in frames)
    port = free_port()
    ready: Any = mp.Queue()
    proc = mp.Process(
        target=tcp_server,
        daemon=True,
        args=(port, max(len(f) for f in frames), total, repeats + 1, ready, spread),
    )
    proc.start()
    ready.get()
    conn = socket.create_connection(("127.0.0.1", port))
    times = []
    for _ in range(repeats + 1):
        start = time.monotonic()
        for f in frames:
            conn.sendall(f)
        conn.recv(1)
        times.append(time.monotonic() - start)
    proc.join()
    return statistics.median(times[1:])


def memcpy_seconds(total: int, repeats: int, device: str = "cpu") -> float:
    """One copy of `total` bytes between two buffers of `device` (on CUDA: device to device)."""
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.monotonic()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.monotonic() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default=None, help="default: zmq,tcp,shm,shm_direct,ucx "
                    "on CPU; tcp,shm,cuda_ipc on CUDA")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="where both caches live: cpu or cuda")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.backends = args.backends or ("tcp,shm,cuda_ipc" if cuda else "zmq,tcp,shm,shm_direct,ucx")
    tune_malloc()
    torch.set_num_threads(1)
    mp.set_start_method("spawn")
    n = args.tokens
    engine = CacheEngine(n, device=args.device)
    engine.cache.data.normal_()
    src = table(n, "source")
    kv_bytes = engine.kv_store.frame_bytes(n) * LLAMA.num_layers
    expected = kv_digest(engine, src, n)
    result: dict[str, Any] = {"kv_bytes": kv_bytes, "tokens": n, "repeats": args.repeats,
                              "device": args.device}  # fmt: skip
    backends = args.backends.split(",")
    runs = [(b, "fresh", f"{b}_gb_s") for b in backends]
    runs += [(b, "fragmented", f"{b}_fragmented_gb_s") for b in ("zmq", "tcp") if b in backends]
    for backend, layout, key in runs:
        seconds, received = asyncio.run(
            run_backend(backend, n, args.repeats, engine, layout, args.device)
        )
        assert received == expected, f"{backend}: the KV did not arrive byte-exact"
        result[key] = round(kv_bytes / seconds / 1e9, 3)
    frames = [engine.kv_store.export_frame(layer, src, n) for layer in range(LLAMA.num_layers)]
    result["raw_tcp_gb_s"] = round(kv_bytes / raw_tcp_seconds(frames, args.repeats) / 1e9, 3)
    spread = raw_tcp_seconds(frames, args.repeats, spread=True)
    result["raw_tcp_spread_gb_s"] = round(kv_bytes / spread / 1e9, 3)
    result["memcpy_gb_s"] = round(kv_bytes / memcpy_seconds(kv_bytes, args.repeats) / 1e9, 3)
    if cuda:
        d2d = memcpy_seconds(kv_bytes, args.repeats, args.device)
        result["device_memcpy_gb_s"] = round(kv_bytes / d2d / 1e9, 3)
    for b in ("zmq", "tcp"):
        for key in (f"{b}_gb_s", f"{b}_fragmented_gb_s"):
            if key in result:
                ratio = result[key] / result["raw_tcp_gb_s"]
                result[key.replace("_gb_s", "_vs_raw_tcp")] = round(ratio, 3)
                ratio = result[key] / result["raw_tcp_spread_gb_s"]
                result[key.replace("_gb_s", "_vs_raw_tcp_spread")] = round(ratio, 3)
    for b in ("shm", "shm_direct"):
        if f"{b}_gb_s" in result:
            result[f"{b}_vs_memcpy"] = round(result[f"{b}_gb_s"] / result["memcpy_gb_s"], 3)
    if "cuda_ipc_gb_s" in result:
        ratio = result["cuda_ipc_gb_s"] / result["device_memcpy_gb_s"]
        result["cuda_ipc_vs_device_memcpy"] = round(ratio, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
