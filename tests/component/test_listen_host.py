"""A node reached at 127.0.0.1 (its gateway on this host: `pdserve up`) listens there, not on
every interface: its data socket and tcp KV listener took anyone's KV fetch and frames from
the network (without a cluster key nothing checks them). A node reached at another address
listens on every interface, as before."""

from __future__ import annotations

import zmq

from pdserve.common.kv.tcp import TcpListener
from pdserve.common.wire.transport import listen_host
from pdserve.decode_node.server import DecodeRole
from tests.component.cluster import Cluster


async def test_a_node_reached_at_loopback_listens_there_only(tokenizer):
    assert listen_host("127.0.0.1") == listen_host("localhost") == "127.0.0.1"
    assert listen_host("10.1.2.3") == listen_host("node-a") == "0.0.0.0"
    async with Cluster(tokenizer) as c:
        node = await c.add(c.node(DecodeRole, "decode-0"))
        assert node.cfg.advertise_host == "127.0.0.1"  # its gateway is local
        data = node.kv.data.getsockopt_string(zmq.LAST_ENDPOINT)
        assert data.startswith("tcp://127.0.0.1:"), data
    for host, bound in (("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "0.0.0.0")):
        listener = TcpListener(host, timeout=5.0)
        try:
            assert listener.sock.getsockname()[0] == bound
        finally:
            listener.sock.close()
