"""A node reached at 127.0.0.1 by its route to the gateway (its gateway on this host: `pdserve
up`) listens there, not on every interface: its data socket and tcp KV listener took
anyone's KV fetch and frames from the network (without a cluster key nothing checks them).
A node reached at another address, or told its address (`--advertise-host`: a port Docker
publishes reaches the container's own interface), listens on every interface, IPv4 and IPv6."""

from __future__ import annotations

import zmq

from pdserve.common.wire.transport import listen_host
from pdserve.decode_node.server import DecodeRole
from tests.component.cluster import Cluster


async def test_a_node_reached_at_loopback_listens_there_only(tokenizer):
    assert listen_host("127.0.0.1") == listen_host("localhost") == "127.0.0.1"
    assert listen_host("10.1.2.3") == listen_host("node-a") == "*"
    async with Cluster(tokenizer) as c:
        local = await c.add(c.node(DecodeRole, "decode-0"))
        told = await c.add(c.node(DecodeRole, "decode-1", advertise_host="127.0.0.1"))
        for node, bound, tcp_bound in ((local, "127.0.0.1", "127.0.0.1"), (told, "[::]", "::")):
            assert node.cfg.advertise_host == "127.0.0.1"
            data = node.kv.data.getsockopt_string(zmq.LAST_ENDPOINT)
            assert data.startswith(f"tcp://{bound}:"), data
            tcp = node.kv.intake.receivers["tcp"].listener.sock.getsockname()[0]
            assert tcp == tcp_bound
