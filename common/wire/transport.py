"""The one socket factory: which side binds, which connects, and the size limits (the
sockets and what travels on them: docs/architecture.md, section 1).

    socket            type    side      peer
    gateway.control   ROUTER  bind      node.control (DEALER, connects, identity = node id)
    gateway.tokens    PULL    bind      decode.tokens (PUSH, connects)
    node.data         ROUTER  bind      node.data_out (DEALER, connects, one per peer whose
                                        data socket this node sends KV or a KvFetch to)

Every socket that accepts network input has a maximum message size, and linger 0 so that
closing never blocks shutdown. Sockets speak IPv6 as well as IPv4 (ZMQ_IPV6). A context made
with a cluster key (common/wire/security.py) gives every socket CurveZMQ: binding sides are
servers, connecting sides clients. A socket is used from its event loop's thread only.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.common.wire.address import EVERYWHERE, LOOPBACK, bracket, split_host_port
from pdserve.common.wire.loop_socket import LoopSocket
from pdserve.common.wire.protocol import Msg, encode
from pdserve.common.wire.security import key_of, secure_socket

CONTROL_MAX_MSG = 64 * 2**20  # prompts up to a few hundred thousand tokens
TOKENS_MAX_MSG = 16 * 2**20

SOCKETS: dict[str, tuple[int, bool]] = {
    "gateway.control": (zmq.ROUTER, True),
    "gateway.tokens": (zmq.PULL, True),
    "node.control": (zmq.DEALER, False),
    "node.data": (zmq.ROUTER, True),
    "node.data_out": (zmq.DEALER, False),
    "decode.tokens": (zmq.PUSH, False),
}


def make_socket(
    ctx: zmq.asyncio.Context,
    name: str,
    address: str,
    *,
    identity: str | None = None,
    max_msg: int | None = None,
) -> zmq.asyncio.Socket:
    kind, binds = SOCKETS[name]
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    address = _localhost_as_ipv4(address)
    # IPv6 literals and names' IPv6 addresses, `*` both families (libzmq falls back to IPv4 on
    # a kernel without IPv6); an IPv4 address as before (with it on, an IPv6 socket mapped)
    sock.setsockopt(zmq.IPV6, not _ipv4(address))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if max_msg is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: raise, don't drop silently
        # a peer reconnecting under its identity (a sender's channel reopened, a node restarted
        # under its id, a DEALER back after a partition while its old connection still looks
        # alive here) takes it over; by default the ROUTER ignores the new connection for good
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if kind in (zmq.PUSH, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer's backlog
    key = key_of(ctx)
    if key is not None:  # --cluster-key: CurveZMQ, the binding side the server
        secure_socket(sock, key, server=binds)
    if binds:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def _ipv4(address: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, split_host_port(address)[0])
    except (OSError, ValueError):  # a name, `*`, IPv6, ipc://
        return False
    return True


def _localhost_as_ipv4(address: str) -> str:
    """`tcp://localhost:P` as 127.0.0.1, as before IPv6 was on: libzmq takes a name's first
    address, and with IPv6 on that is ::1 where /etc/hosts names it so (Fedora), which a
    peer on 127.0.0.1 never hears."""
    host, sep, rest = address.partition("localhost:")
    return f"{host}127.0.0.1:{rest}" if sep and host == "tcp://" else address


def listen_host(advertise_host: str) -> str:
    """Where a node's data sockets listen: loopback when it is reached there (a cluster on one
    host: 127.0.0.1, or ::1), else every interface. A node reachable at 127.0.0.1 alone
    listened on every interface too, and took anyone's KV fetch and frames (without a key
    nothing checks them)."""
    return LOOPBACK.get(advertise_host.strip("[]"), EVERYWHERE)


def bound_address(sock: zmq.asyncio.Socket, advertise_host: str) -> str:
    """The address peers should use for a socket bound to a wildcard or port 0."""
    _, port = split_host_port(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return f"tcp://{bracket(advertise_host)}:{port}"


_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range() -> tuple[int, int]:
    """Where free_port draws: below the kernel's ephemeral range, or PDSERVE_PORT_RANGE
    ("low-high"), which keeps processes that pick ports at once (test workers) apart."""
    given = os.environ.get("PDSERVE_PORT_RANGE", "")
    low, _, high = given.partition("-")
    if low.isdigit() and high.isdigit() and int(low) < int(high):
        return int(low), int(high)
    return 10_000, max(_ephemeral_low(), 10_001)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now for a process started later to bind. Taken below the kernel's
    ephemeral range: a port the kernel handed out (bind to 0) can be given again to any
    outgoing connection before the later process binds it (seen: a gateway's ZeroMQ bind
    failing with EADDRINUSE under a loaded test run). Never the same port twice per process."""
    low, high = _port_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def send(
    sock: zmq.asyncio.Socket | LoopSocket, msg: Msg, *frames: Any, to: bytes | None = None
) -> None:
    """Send one message (plus raw frames, zero-copy) optionally to a ROUTER peer."""
    parts: list[Any] = [encode(msg), *frames]
    if to is not None:
        parts.insert(0, to)
    await sock.send_multipart(parts, copy=False)


def decode_or_none(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
    """Typed decoding; None (to be logged by the caller) for anything malformed."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
