"""Where a node is: its default id, the address peers reach it at, the host identity that
decides whether two nodes may share memory."""

from __future__ import annotations

import os
import socket

from pdserve.common.node_id import default_id, id_problem
from pdserve.common.wire.address import LOOPBACK, host_port, split_host_port


def default_node_id(role: str) -> str:
    """The compose container name (`pdserve-prefill-2`) in Docker, else ROLE-HOSTNAME-PID,
    the host name cut to fit (common/node_id.py)."""
    from pdserve.common.container import container_name

    name = container_name()
    if name and id_problem(name) is None:
        return name
    return default_id(role, socket.gethostname(), os.getpid())


def _host_of(address: str) -> str:
    """`tcp://gateway:8001` -> `gateway`; `tcp://[::1]:8001` -> `::1`; `ipc://PATH` -> PATH."""
    try:
        return split_host_port(address)[0]
    except ValueError:  # no port: ipc://
        return address.split("://", 1)[-1]


def facing_address(gateway: str) -> str:
    """This host's address on the route to the gateway: what peers can reach us at when no
    --advertise-host is given (127.0.0.1 or ::1 for a local gateway, the container's address
    on the compose network). A UDP connect sends nothing; it only asks the kernel for the
    route: over IPv4 first, as before IPv6 was spoken, over IPv6 where IPv4 has none (a
    gateway name or address in an IPv6-only network)."""
    host = _host_of(gateway)
    if host in LOOPBACK or host in ("*", ""):
        return LOOPBACK.get(host, "127.0.0.1")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return socket.gethostname()


def resolve_tokens_address(address: str, gateway: str) -> str:
    """The gateway may leave its tokens host empty ("tcp://:8002"): then it is the host this
    node registered through, which is by construction one the node can reach."""
    if address.startswith("tcp://:"):
        return f"tcp://{host_port(_host_of(gateway), address.rsplit(':', 1)[1])}"
    return address


def host_identity() -> str:
    """Equal exactly for processes that can share /dev/shm: the same kernel (boot id) and the
    same IPC namespace. Containers sharing an IPC namespace match; hostnames do not matter."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ipc_ns = os.readlink("/proc/self/ns/ipc")
    except OSError:
        return f"{socket.gethostname()}/{os.getpid()}"  # unknown: never share memory
    return f"{boot}/{ipc_ns}"
