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


def node_ports_free(cfg: NodeConfig) -> None:
    """A node's fixed ports (0: any free one), as `ports_free`."""
    for host, port, name in ((cfg.metrics_host, cfg.metrics_port, "--metrics-port"),
                             ("", cfg.data_port, "--data-port"),
                             ("", cfg.kv_tcp_port, "--kv-tcp-port")):  # fmt: skip
        if port:
            _bindable(host, port, name)


def _bindable(host: str, port: int, name: str) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        try:
            probe.bind(("0.0.0.0" if host in ("", "::", "*") else host, port))
        except (OSError, OverflowError) as exc:  # OverflowError: past 65535
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            raise ConfigError(f"{name}: port {port} is in use or not ours ({why})") from None
