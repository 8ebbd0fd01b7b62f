"""What a process can learn about its container: the name compose gave it.

Compose names replicas PROJECT-SERVICE-N, but inside the container the hostname is the
container id and /etc/hosts maps the address to that id, so the name has to come from
Docker's embedded DNS server (127.0.0.11), which answers a reverse (PTR) query for the
container's address with `NAME.NETWORK`. The name gives nodes a readable default id
(`pdserve-prefill-2`, in metrics and logs) and `cuda:auto` its replica number. Outside
Docker nothing answers and the callers fall back.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import struct

DOCKER_DNS = ("127.0.0.11", 53)


def ptr_query(address: str, query_id: int) -> bytes:
    labels = [*reversed(address.split(".")), "in-addr", "arpa"]
    qname = b"".join(bytes([len(x)]) + x.encode() for x in labels) + b"\0"
    header = struct.pack(">HHHHHH", query_id, 0x0100, 1, 0, 0, 0)  # recursion desired
    return header + qname + struct.pack(">HH", 12, 1)  # PTR, IN


def _read_name(packet: bytes, pos: int) -> tuple[str, int]:
    """A DNS name at `pos` (with compression pointers); returns it and the position after."""
    labels: list[str] = []
    end = -1
    for _ in range(128):  # bounded: a malicious loop of pointers ends here
        length = packet[pos]
        if length == 0:
            pos += 1
            break
        if length & 0xC0 == 0xC0:
            if end < 0:
                end = pos + 2
            pos = ((length & 0x3F) << 8) | packet[pos + 1]
            continue
        labels.append(packet[pos + 1 : pos + 1 + length].decode("ascii", "replace"))
        pos += 1 + length
    return ".".join(labels), end if end >= 0 else pos


def parse_ptr_answer(packet: bytes, query_id: int) -> str | None:
    """The first PTR record's name in a DNS response, or None."""
    if len(packet) < 12:
        return None
    rid, flags, qdcount, ancount = struct.unpack(">HHHH", packet[:8])
    if rid != query_id or not flags & 0x8000 or flags & 0x000F or ancount == 0:
        return None
    pos = 12
    for _ in range(qdcount):
        pos = _read_name(packet, pos)[1] + 4
    for _ in range(ancount):
        pos = _read_name(packet, pos)[1]
        rtype, _cls, _ttl, rdlength = struct.unpack(">HHIH", packet[pos : pos + 10])
        pos += 10
        if rtype == 12:
            return _read_name(packet, pos)[0]
        pos += rdlength
    return None


def embedded_dns(resolv_conf: str = "/etc/resolv.conf") -> bool:
    """Docker gives a container its embedded DNS server (and lists it in resolv.conf) only
    on a user-defined network, as compose's are; on the default bridge or the host's
    network nothing listens at 127.0.0.11, and asking would wait the whole timeout."""
    try:
        with open(resolv_conf, errors="replace") as f:
            lines = [line.split() for line in f]
    except OSError:
        return False
    return any(w[:2] == ["nameserver", DOCKER_DNS[0]] for w in lines)


def container_name(timeout: float = 0.5) -> str | None:
    """`pdserve-prefill-2` when compose runs us, else None."""
    if not os.path.exists("/.dockerenv") or not embedded_dns():
        return None
    try:
        address = socket.gethostbyname(socket.gethostname())
        query_id = secrets.randbits(16)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.sendto(ptr_query(address, query_id), DOCKER_DNS)
            answer = parse_ptr_answer(s.recv(512), query_id)
    except (OSError, IndexError, struct.error):
        return None
    return answer.split(".", 1)[0] if answer else None


def replica_from_name(name: str) -> int | None:
    """`pdserve-decode-3` -> 3 (compose names replicas PROJECT-SERVICE-N)."""
    match = re.search(r"-(\d+)$", name)
    return int(match.group(1)) if match else None
