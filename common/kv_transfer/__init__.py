"""How KV bytes move from a prefill node to a decode node. Control messages (KvHeader,
KvLayer descriptors, KvDone, KvAck/KvRefuse) always travel over the ZeroMQ data sockets;
the backend decides where each layer's frame (K then V for the request's tokens, one
contiguous buffer, see common/engine/kv_cache.py) travels:

    zmq  the frame rides as an extra part of the KvLayer multipart message, sent with
         copy=False from the exported buffer; the decode node scatters it from ZeroMQ's
         receive buffer into its paged cache (one copy).
    shm  same host / IPC namespace: the prefill node exports each layer straight into a
         reusable /dev/shm segment; the descriptor names the segment and the decode node
         copies from it into its cache (one copy on each side, no socket).
    ucx  a UCX endpoint (ucxx; RDMA or NVLink on GPU boxes, TCP here) carries the frame into
         a reused receive buffer, then one copy into the cache.

`auto` picks shm when both nodes registered the same host identity, else zmq. UCX is used
when asked for (`--kv-backend ucx`): over plain TCP it is slower than our ZeroMQ path
(benchmarks/kv_transfer.py), its gain is on RDMA fabrics.
"""

from __future__ import annotations

BACKENDS = ("auto", "zmq", "shm", "ucx")


def choose_backend(forced: str, my_host: str, target_host: str, target_ucx: str) -> str:
    if forced == "shm" and my_host != target_host:
        return "zmq"  # cannot share memory across hosts: fall back rather than fail
    if forced == "ucx" and not target_ucx:
        return "zmq"
    if forced != "auto":
        return forced
    return "shm" if my_host == target_host else "zmq"
