"""The fixed ports a process will bind, tried before it starts its work: a taken or
impossible port is a ConfigError naming its flag, not a bind's traceback (a ZeroMQ one for
the gateway's control port), and for a node not after its model has loaded."""

from __future__ import annotations

import errno
import socket

from pdserve.common.config import GatewayConfig, NodeConfig
from pdserve.common.errors import ConfigError


def ports_free(configs: list[GatewayConfig]) -> None:
    """Refuse ports something listens on: another cluster's /health answered the wait
    ("is up") while this one's gateway failed its bind, and its nodes joined the other."""
    for g in configs:
        for port, name in ((g.port, "--port"), (g.control_port, "--control-port"),
                           (g.tokens_port, "--tokens-port")):  # fmt: skip
            _bindable(g.host, port, name)


def node_ports_free(cfg: NodeConfig, role: str) -> None:
    """A node's fixed ports (0: any free one), as `ports_free`; the tcp KV listener's of a
    prefill or decode node too."""
    ports = [
        (cfg.metrics_host, cfg.metrics_port, "--metrics-port"),
        ("", cfg.data_port, "--data-port"),
    ]
    if role in ("prefill", "decode"):  # both open the tcp KV listener
        ports.append(("", cfg.kv_tcp_port, "--kv-tcp-port"))
    for host, port, name in ports:
        if port:
            _bindable(host, port, name)


def metrics_ports_free(host: str, first: int, count: int) -> None:
    """`up --node-metrics-port`: the nodes' consecutive ports (0: none)."""
    for port in range(first, first + count) if first else ():
        _bindable(host, port, "--node-metrics-port")


def _bindable(host: str, port: int, name: str) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}: port {port} is not a TCP port (0 to 65535)")
    try:  # every address the host names, in its family (IPv4 and IPv6, a name)
        found = socket.getaddrinfo(None if host in ("", "*", "0.0.0.0") else host, port,
                                   type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror as exc:
        raise ConfigError(f"{name}: cannot resolve {host!r} ({exc.strerror})") from None
    for family, *_, address in found:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # a family this host has not (IPv6 off): no server binds there either
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
            if family == socket.AF_INET6:  # this address alone, not IPv4's through it
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 turned off here (a container's sysctl): nothing binds it
                why = f"{name}: port {port} is in use or not ours ({exc.strerror})"
                raise ConfigError(why) from None
