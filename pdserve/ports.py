"""The fixed ports a process will bind, tried before it starts its work: a taken or
impossible port is a ConfigError naming its flag, not a bind's traceback (a ZeroMQ one for
the gateway's control port), and for a node not after its model has loaded."""

from __future__ import annotations

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
    """A node's fixed ports (0: any free one), as `ports_free`; a decode node's tcp KV
    listener's too (the others do not open it)."""
    ports = [
        (cfg.metrics_host, cfg.metrics_port, "--metrics-port"),
        ("", cfg.data_port, "--data-port"),
    ]
    if role == "decode":
        ports.append(("", cfg.kv_tcp_port, "--kv-tcp-port"))
    for host, port, name in ports:
        if port:
            _bindable(host, port, name)


def _bindable(host: str, port: int, name: str) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}: port {port} is not a TCP port (0 to 65535)")
    try:  # the address the server binds, in its family (an IPv6 host, a name)
        family, *_, address = socket.getaddrinfo(
            None if host in ("", "*", "0.0.0.0") else host,
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )[0]
    except socket.gaierror:
        return  # not resolvable here: the server's own bind says so
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"{name}: port {port} is in use or not ours ({exc.strerror})"
            ) from None
