"""A node's gateways: one control link per gateway, and which gateway each request belongs to.

Several gateways may serve one cluster (docs/architecture.md, "Several gateways"). A node
registers, heartbeats and publishes its prefix cache to each; a request belongs to the
gateway that offered it (a prefill or colocated node) or that the prefill node names in the
KV header (a decode node). Everything a request produces goes to its gateway alone, and only
its gateway may abort, redirect or move it. With one gateway every request is its.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq

from pdserve.common.node.host import resolve_tokens_address
from pdserve.common.wire.address import host_port
from pdserve.common.wire.protocol import GatewayLoad, Msg, encode
from pdserve.common.wire.transport import CONTROL_MAX_MSG, make_socket, send


def beat_delay(now: float, interval: float) -> float:
    """Seconds to the next heartbeat: at the wall clock's multiples of the interval, so all
    nodes' beats reach a gateway together and few wake-ups of its event loop read them (a
    wake-up costs a busy gateway ~0.2 ms of CPU: docs/results/README.md, "Several
    gateways")."""
    return interval - now % interval


class GatewayLink:
    """The control DEALER to one gateway, and the PUSH socket for the tokens it receives."""

    def __init__(self, ctx: Any, address: str, identity: str) -> None:
        self.ctx, self.address = ctx, address
        self.control = make_socket(ctx, "node.control", address, identity=identity,
                                   max_msg=CONTROL_MAX_MSG)  # fmt: skip
        self.registered = False
        self.gateway_id = ""  # RegisterAck.gateway_id: a new value is a new gateway process
        self.last_reply = time.monotonic()
        self.tokens_address = ""
        self.tokens_sock: Any = None
        # unanswered for heartbeat_timeout since: its requests are orphans (adoption.py)
        self.silent_since: float | None = None
        self.task: Any = None  # its control loop
        self.load: GatewayLoad | None = None  # what the gateway last said of its load
        self.refused = False  # refused this node: not registered with again, nor deregistered
        self.asked = False  # a Register sent (Gateways.register): it gets the Deregister

    async def send(self, msg: Msg) -> None:
        await send(self.control, msg)

    async def push(self, msg: Msg) -> None:
        """A token batch or preemption to this gateway's PULL socket (decode, colocated)."""
        if self.tokens_sock is not None:
            await self.tokens_sock.send(encode(msg))

    def registered_as(self, gateway_id: str) -> None:
        """Registered with the gateway `gateway_id` (its token address connected first)."""
        self.registered, self.gateway_id = True, gateway_id

    def connect_tokens(self, tokens_address: str, pushes: bool) -> None:
        """Where token batches go. Raises on an address it cannot use, before any change."""
        address = resolve_tokens_address(tokens_address, self.address)
        if pushes and self.tokens_sock is None:
            self.tokens_sock = make_socket(self.ctx, "decode.tokens", address)
        self.tokens_address = address

    def reply_due(self, timeout: float, interval: float) -> bool:
        """Ask this gateway to answer this heartbeat: when it has said nothing for more than
        one and a half intervals, so it answers every second beat at most and its last word
        is at most two intervals old. A gateway stalled for `timeout` less two intervals
        (1 s at the defaults) is still not taken for silent; the margin is never below one
        interval (a timeout under three intervals: every beat asks)."""
        quiet = time.monotonic() - self.last_reply
        return not self.registered or quiet > min(1.5 * interval, timeout - 2 * interval)

    def silent_for(self) -> float:
        """Seconds since it was taken for silent; -1 while it is not."""
        return -1.0 if self.silent_since is None else time.monotonic() - self.silent_since

    def replies_waiting(self) -> bool:
        """Replies queued unread (this node's loop was late, not the gateway silent)."""
        events = self.control.getsockopt(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    def close(self) -> None:
        if self.tokens_sock is not None:
            self.tokens_sock.close()
        self.control.close()


@dataclass
class Gone:
    """A gateway process that is no more (it came back under a new id): its requests are
    orphans until another gateway adopts them or `--orphan-grace` passes."""

    gateway_id: str
    since: float
    freed: bool = False  # nobody's: freed at the grace's end (its step may still run)


Owner = GatewayLink | Gone


class Owners:
    """Request wire id -> the link of the gateway it belongs to. An entry lives while the node
    holds the request and one sweep more (a late KvTransferred record still finds its way)."""

    def __init__(self) -> None:
        self.of: dict[str, Owner] = {}
        self.absent: set[str] = set()  # not held at the last sweep

    def adopt(self, rid: str, owner: Owner) -> bool:
        """`rid` belongs to `owner` (False: it belongs to another gateway)."""
        self.absent.discard(rid)
        return self.of.setdefault(rid, owner) is owner

    def move(self, rid: str, owner: Owner) -> None:
        """An orphan adopted by another gateway, or a gone gateway's request."""
        self.of[rid] = owner

    def get(self, rid: str) -> Owner | None:
        return self.of.get(rid)

    def owned(self, owner: Owner) -> list[str]:
        return [rid for rid, o in self.of.items() if o is owner]

    def orphan(self, rid: str) -> bool:
        """Its gateway is gone or silent: nobody receives its tokens."""
        owner = self.of.get(rid)
        if isinstance(owner, Gone):
            return not owner.freed
        return owner is not None and owner.silent_since is not None

    def sweep(self, held: set[str]) -> None:
        """Forget requests the node has not held for two sweeps."""
        for rid in [r for r in self.absent if r not in held]:
            self.of.pop(rid, None)
        self.absent = {rid for rid in self.of if rid not in held}


def gateway_addresses(given: str) -> list[str]:
    """The gateways a node serves: `--gateway` repeated or comma-separated; a host name is
    one gateway per address it resolves to (a Kubernetes headless Service: one per pod),
    or the name itself while it resolves to none (ZeroMQ keeps trying it)."""
    found: list[str] = []
    unresolved: list[str] = []
    for address, ips in resolve(given).items():
        if not ips and _name(address) is not None:
            unresolved.append(address)
            continue
        for one in ips or [address]:
            if one not in found:
                found.append(one)
    # a name resolving to nothing goes to ZeroMQ only when nothing else does: libzmq looks it
    # up in its I/O thread at every reconnect, holding up every socket of the node (a stopped
    # compose gateway's name waits out the DNS timeout each time); with other gateways the
    # discovery loop links it once it resolves
    return found or unresolved


def configured(given: str) -> list[str]:
    return list(dict.fromkeys(a.strip() for a in given.split(",") if a.strip()))


def dynamic(given: str) -> bool:
    """Whether any configured gateway is a host name (resolved again while serving)."""
    return any(_name(a) is not None for a in configured(given))


def resolve(given: str) -> dict[str, list[str]]:
    """Each configured address -> the tcp:// addresses its host name resolves to now ([]:
    none, or it is no name). Names are looked up side by side: one that fails slowly (a
    stopped gateway's name, the resolver's timeout) holds up the others by nothing, where
    one after another a node's start and each discovery round waited the sum."""
    addresses = configured(given)
    names = [a for a in addresses if _name(a) is not None]
    if len(names) < 2:
        return {a: _resolve(a) for a in addresses}
    with ThreadPoolExecutor(len(names), thread_name_prefix="resolve") as pool:
        found = dict(zip(names, pool.map(_resolve, names), strict=True))
    return {a: found[a] if a in found else [] for a in addresses}


def _name(address: str) -> tuple[str, int] | None:
    parts = urlsplit(address)
    host, port = parts.hostname, parts.port
    if parts.scheme != "tcp" or not host or port is None or _is_ip(host) or host == "localhost":
        return None
    return host, port


def _resolve(address: str) -> list[str]:
    named = _name(address)
    if named is None:
        return []
    host, port = named
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []  # not resolvable yet
    # its IPv4 addresses, as before IPv6 was spoken (a name with both would count each
    # gateway twice); its IPv6 ones where it has none (an IPv6-only cluster)
    ips = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET}) or sorted(
        {str(info[4][0]) for info in infos if info[0] == socket.AF_INET6})  # fmt: skip
    return [f"tcp://{host_port(ip, port)}" for ip in ips]


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
