"""Host and port as an address writes them, IPv4 and IPv6 alike: an IPv6 literal in brackets
(`tcp://[::1]:8001`, `http://[fd00::2]:8000`, `[::1]:5000`), read back without them (what
socket calls take)."""

from __future__ import annotations

import errno
import socket

EVERYWHERE = "*"  # a listener on every interface, IPv4 and IPv6 (ZeroMQ writes it so)
# the hosts a cluster on one machine is reached at, and the loopback address each listens on
LOOPBACK = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "::1": "::1"}


def bracket(host: str) -> str:
    """`::1` -> `[::1]`; an IPv4 address, a name, `*` or a host already bracketed as given."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int | str) -> str:
    return f"{bracket(host)}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """`tcp://[::1]:8001`, `[::1]:8001`, `10.0.0.1:8001`, `gw:8001` -> (host, port), the host
    without brackets. The port is what follows the last colon, so an unbracketed IPv6 literal
    (`::1:8001`) reads as ZeroMQ reads it. ValueError where no port follows."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"no port in {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening). EVERYWHERE: one IPv6 socket that
    takes IPv4 too (IPV6_V6ONLY off), or IPv4's alone on a kernel without IPv6."""
    if host != EVERYWHERE:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return _bound(family, host.strip("[]"), port)
    try:
        return _bound(socket.AF_INET6, "::", port)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise  # a port in use is one in both families
        return _bound(socket.AF_INET, "0.0.0.0", port)


def _bound(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
