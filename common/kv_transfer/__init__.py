"""How KV bytes move from a prefill node to a decode node. Control messages (KvHeader,
KvLayer descriptors, KvDone, KvAck/KvRefuse) always travel over the ZeroMQ data sockets;
the backend decides where each layer's frame (K then V for the request's tokens, one
contiguous buffer, see common/engine/kv_cache.py) travels:

    zmq  the frame rides as extra parts of the KvLayer multipart message, sent with
         copy=False from views of the paged cache; the decode node copies it from ZeroMQ's
         receive buffers into its paged cache.
    tcp  a raw TCP stream per peer pair carries the frame from views of the prefill cache
         straight into the decode node's reserved blocks (recv_into): one kernel copy on
         each side, like a plain socket (common/kv_transfer/tcp.py).
    shm  same host / IPC namespace: the prefill node exports each layer straight into a
         reusable /dev/shm segment; the descriptor names the segment and the decode node
         copies from it into its cache (one copy on each side, no socket).
    ucx  a UCX endpoint (ucxx; RDMA or NVLink on GPU boxes, TCP here) carries the frame into
         a reused receive buffer, then one copy into the cache.

`auto` picks shm when both nodes registered the same host identity, else tcp (zmq for a
peer without a TCP listener). UCX is used when asked for (`--kv-backend ucx`): over plain
TCP it is slower than our sockets (benchmarks/kv_transfer.py), its gain is on RDMA fabrics.
"""

from __future__ import annotations

from pdserve.common.protocol import DecodeTarget

BACKENDS = ("auto", "zmq", "shm", "ucx", "tcp")


def choose_backend(forced: str, my_host: str, target: DecodeTarget) -> str:
    """What carries the frames to `target`; a forced backend the peer cannot take falls
    back to zmq rather than failing the request."""
    same_host = my_host == target.host_id
    if forced == "auto":
        return "shm" if same_host else ("tcp" if target.tcp_address else "zmq")
    if (
        (forced == "shm" and not same_host)
        or (forced == "ucx" and not target.ucx_address)
        or (forced == "tcp" and not target.tcp_address)
    ):
        return "zmq"
    return forced
