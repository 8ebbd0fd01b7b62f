"""A peer at one of a node's gateway addresses that answers in good form with what the node
cannot act on (a token address it cannot connect to) changes nothing at the node: the message
is dropped with a log and the node serves on with its other gateway. A gateway link the node
lets go (a name that now resolves to others, a pod gone) does not fail the node's stop."""

from __future__ import annotations

import asyncio

from pdserve.common.node.adoption import _attempt
from pdserve.common.wire.protocol import NODE_DECODER, Register, RegisterAck, encode
from pdserve.common.wire.transport import free_port, make_socket
from pdserve.decode_node.server import DecodeRole
from tests.component.cluster import TIMEOUT, Cluster


async def _from_node(sock) -> tuple[bytes, object]:
    ident, payload = await asyncio.wait_for(sock.recv_multipart(), TIMEOUT)
    return ident, NODE_DECODER.decode(payload)


async def test_a_rogue_gateway_cannot_stop_a_node_and_a_dropped_link_ends_cleanly(tokenizer):
    async with Cluster(tokenizer) as c:
        address = f"tcp://127.0.0.1:{free_port()}"
        rogue = make_socket(c.gw.link.ctx, "gateway.control", address)
        try:
            node = c.node(DecodeRole, "decode-0", gateway=f"{c.address},{address}")
            task = c.start(node)
            await asyncio.wait_for(node.registered.wait(), TIMEOUT)  # the real gateway
            ident, msg = await _from_node(rogue)
            assert isinstance(msg, Register)
            # an address ZeroMQ refuses: the node's control loop for this link raised, and a
            # loop that dies stops the node (every request it held re-placed)
            bad = RegisterAck(node_id="decode-0", tokens_address="tcp://:x", gateway_id="g1")
            await rogue.send_multipart([ident, encode(bad)])
            for _ in range(3):  # its next messages: the loop read past the ack long before
                await _from_node(rogue)
            assert not node.stopped.is_set() and not task.done()
            link = next(k for k in node.control.links if k.address == address)
            assert not link.registered and not link.task.done()
            # the same gateway answering well: registered with both
            good = RegisterAck(node_id="decode-0", tokens_address=f"tcp://127.0.0.1:{free_port()}",
                               gateway_id="g1")  # fmt: skip
            await rogue.send_multipart([ident, encode(good)])
            for _ in range(50):
                if link.registered:
                    break
                await _from_node(rogue)
            assert link.registered
            # let that link go, as the discovery loop does: its loop is cancelled, which the
            # node's stop read as a failed loop (CancelledError out of serve())
            node.control._drop_link(link)
            await c.stop(node, task)
            assert task.done() and not task.cancelled() and task.exception() is None
        finally:
            rogue.close()


def test_a_wire_id_without_an_attempt_is_attempt_minus_one():
    """Wire ids are a gateway's (request id + "." + attempt); a stray peer's without a dot
    raised IndexError in the node's control loop when an Adopt named its request."""
    assert _attempt("cmpl-1.3") == 3
    assert _attempt("noattempt") == -1 and _attempt("x.") == -1 and _attempt("") == -1
