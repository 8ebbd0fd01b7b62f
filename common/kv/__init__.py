"""How KV bytes move from a prefill node to a decode node: connectors by name.

Control messages (KvHeader, KvLayer descriptors, KvDone, KvAck/KvRefuse) always travel over
the ZeroMQ data sockets (sender.py, intake.py); a backend decides where each layer's frame (K
then V for the request's tokens, one contiguous buffer, see common/engine/kv_cache.py)
travels. Each is one module with a `CONNECTOR` (base.py says what one must do):

    zmq  the frame rides as extra parts of the KvLayer message, sent with copy=False from views
         of the paged cache; the decode node copies it from ZeroMQ's buffers into its cache.
    tcp  a raw TCP stream per peer pair, self-describing frames read straight into the
         reserved blocks: one kernel copy on each side (tcp.py).
    shm  same host / IPC namespace: a reusable /dev/shm segment per request; one copy on
         each side, no socket.
    shm_direct  same host, the decode node's cache itself in /dev/shm: the prefill node
         copies each layer from its blocks into the reserved ones, one copy in all.
    cuda_ipc  the same between CUDA caches on one host: the decode node's cache shared by a
         CUDA IPC handle, one device-to-device copy per layer (NVLink or PCIe).
    ucx  a UCX endpoint (ucxx; RDMA or NVLink on GPU boxes, TCP here) into a reused buffer.

Decode nodes advertise `kv_endpoints` ({backend: endpoint}) when they register. `auto` takes
the usable backend of lowest rank (on one host cuda_ipc or shm_direct, then shm; else tcp,
else zmq);
ucx is used when asked for: over plain TCP it is slower than our sockets
(benchmarks/kv_transfer.py), its gain is on RDMA fabrics. A forced backend the peer cannot
take falls back to zmq rather than failing the request.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.common.kv_backends import BACKENDS, CHOICES

if TYPE_CHECKING:
    from pdserve.common.kv.base import Backend, Local, ReceiveConnector
    from pdserve.common.kv.landing import FrameSink


def backend(name: str) -> Backend:
    """The backend registered as `name` (imported on first use: ucx pulls in ucxx)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown KV backend {name!r}: choose one of {list(CHOICES)}")
    return importlib.import_module(BACKENDS[name]).CONNECTOR  # type: ignore[no-any-return]


def choose(forced: str, usable: Callable[[str, str], bool], endpoints: dict[str, str]) -> str:
    """The backend that carries frames to a decode node advertising `endpoints`: the forced
    one if the peer can take it, else zmq; with `auto`, the usable one of lowest rank.
    `usable(name, endpoint)` asks that backend's sender whether it can reach the endpoint."""
    if forced != "auto":
        return forced if forced in endpoints and usable(forced, endpoints[forced]) else "zmq"
    ranked = sorted(
        (rank, name)
        for name in BACKENDS
        if name in endpoints and (rank := backend(name).auto_rank) is not None
    )
    return next((name for _, name in ranked if usable(name, endpoints[name])), "zmq")


# Backends that copy between torch caches directly (direct.py): they need a torch engine's
# cache, so a process that has not loaded torch (a sim node) has none to offer and does not
# import them, nor torch with them (1.5 s of every sim node's start).
DIRECT = ("shm_direct", "cuda_ipc")


def receivers_for(local: Local) -> dict[str, ReceiveConnector]:
    """A decode node's receiving side of every backend it can have (each decides at `listen`
    whether it is offered)."""
    names = [n for n in BACKENDS if n not in DIRECT or "torch" in sys.modules]
    return {name: backend(name).receive(local) for name in names}


async def listen_all(receivers: dict[str, ReceiveConnector], sink: FrameSink) -> dict[str, str]:
    """Start every receiver; the endpoints of those offered, to advertise (`kv_endpoints`)."""
    endpoints = {}
    for name, receiver in receivers.items():
        endpoint = await receiver.listen(sink)
        if endpoint:
            endpoints[name] = endpoint
    return endpoints
