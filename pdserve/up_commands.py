"""`pdserve up`'s settings and its children's command lines: the gateways' and each node's,
from the one set of flags `up` was given (pdserve/launch.py starts and supervises them)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.costmodel import DEFAULT_PROFILE
from pdserve.common.errors import ConfigError
from pdserve.common.flags import from_args
from pdserve.common.wire.address import bracket
from pdserve.spawn import cores

# node settings `pdserve up` decides per node itself (addresses, ports, ids)
PER_NODE = (
    "gateway",
    "node_id",
    "advertise_host",
    "metrics_port",
    "metrics_host",
    "data_port",
    "kv_tcp_port",
)


def to_flags(cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags that reproduce the non-default fields of a config dataclass."""
    flags: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or value == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else f"--no-{f.name.replace('_', '-')}")
        else:
            flags += [name, str(value)]
    return flags


def up_configs(args: argparse.Namespace) -> tuple[GatewayConfig, NodeConfig]:
    """`pdserve up`'s gateway and node settings. They share every flag but the heartbeat
    timeouts: --gateway-heartbeat-timeout / --node-heartbeat-timeout set one side each,
    --heartbeat-timeout both."""
    gateway_side = getattr(args, "gateway_heartbeat_timeout", None)
    node_side = getattr(args, "node_heartbeat_timeout", None)
    gcfg = from_args(GatewayConfig, args, **_given(heartbeat_timeout=gateway_side))
    ncfg = from_args(NodeConfig, args, **_given(heartbeat_timeout=node_side))
    if gcfg.heartbeat_timeout <= ncfg.heartbeat_interval:  # live nodes dropped between beats
        raise ConfigError("the gateways' --heartbeat-timeout must exceed --heartbeat-interval")
    prefill, decode, colocated = (getattr(args, r, 0) for r in ("prefill", "decode", "colocated"))
    if min(prefill, decode, colocated) < 0 or not prefill + decode + colocated:
        raise ConfigError("--prefill, --decode and --colocated count nodes: >= 0, one at least")
    # a switch leaves one node at least in the role it leaves (gateway/roles.py)
    switching = gcfg.role_switching == "on" and prefill + decode >= 2
    if not (colocated or (prefill and decode) or switching):  # else: never healthy
        raise ConfigError(
            f"--prefill {prefill} --decode {decode}: nothing would run the other phase; give "
            "both at least 1, or --colocated 1 or more, or two nodes and --role-switching on"
        )
    return gcfg, ncfg


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def cluster_commands(args: argparse.Namespace) -> list[list[str]]:
    gcfg, ncfg = up_configs(args)
    ecfg = from_args(EngineConfig, args)
    node_flags = to_flags(ncfg, skip=PER_NODE)
    nodes = args.prefill + args.decode + args.colocated
    if ecfg.engine == "torch" and not ecfg.num_threads:
        ecfg = dataclasses.replace(ecfg, num_threads=max(1, cores() // nodes))
    base = [sys.executable, "-m", "pdserve.cli", "--log-level", args.log_level]
    base += ["--log-format", getattr(args, "log_format", "text")]
    if ecfg.engine == "sim" and gcfg.cost_time_scale == 1.0:
        # the gateway's cost rules speak the sim engines' clock
        gcfg = dataclasses.replace(gcfg, cost_time_scale=ecfg.sim_time_scale)
    if ecfg.engine == "sim" and gcfg.cost_profile == DEFAULT_PROFILE:  # and model its GPUs
        gcfg = dataclasses.replace(gcfg, cost_profile=ecfg.sim_profile)
    # the nodes' tokenizer (the gateway refuses a node that tokenizes otherwise)
    gcfg = dataclasses.replace(gcfg, model=tokenizer_model(ecfg))
    if getattr(args, "gateways", 1) < 1:
        raise ConfigError("--gateways must be at least 1")
    cmds = []
    gateways = gateway_configs(gcfg, getattr(args, "gateways", 1))
    for g in gateways:
        cmds.append([*base, "gateway", *to_flags(g, skip=("scheduler", *SECRETS)),
                     "--scheduler", g.scheduler])  # fmt: skip
    # nodes reach the gateways where they listen: a given --host unless it is a wildcard
    wildcard = gcfg.host in ("", "0.0.0.0", "::")
    host = bracket(gcfg.advertise_host or ("127.0.0.1" if wildcard else gcfg.host))
    address = ",".join(f"tcp://{host}:{g.control_port}" for g in gateways)
    roles = (("prefill", args.prefill), ("decode", args.decode), ("colocated", args.colocated))
    gpu = ecfg.gpu_offset  # cuda:auto: a GPU each, in turn (no replica number tells them)
    for role, count in roles:
        threads = getattr(args, f"{role}_threads", 0)  # --prefill-threads, --decode-threads
        if threads < 0:
            raise ConfigError(f"--{role}-threads: 0 (the rule) or more")
        role_cfg = dataclasses.replace(ecfg, num_threads=threads) if threads else ecfg
        if role == "prefill" and getattr(args, "prefill_priority", "normal") == "idle":
            role_cfg = dataclasses.replace(role_cfg, engine_priority="idle")
        for i in range(count):
            node = [*base, role, "--gateway", address, "--node-id", f"{role}-{i}"]
            if metrics := getattr(args, "node_metrics_port", 0):  # node k on metrics + k
                node += ["--metrics-port", str(metrics + len(cmds) - len(gateways)),
                         "--metrics-host", ncfg.metrics_host]  # fmt: skip
            if ecfg.device == "cuda:auto":
                role_cfg, gpu = dataclasses.replace(role_cfg, gpu_offset=gpu), gpu + 1
            cmds.append([*node, *to_flags(role_cfg), *node_flags])
    return cmds


GATEWAY_PORT_STRIDE = 10  # `pdserve up --gateways N`: gateway i's ports are the first's + 10 i


def gateway_configs(gcfg: GatewayConfig, count: int) -> list[GatewayConfig]:
    """The gateways of `pdserve up --gateways N`: the same settings, each on its own ports."""
    step = GATEWAY_PORT_STRIDE
    ports = [(gcfg.port + step * i, gcfg.control_port + step * i, gcfg.tokens_port + step * i)
             for i in range(count)]  # fmt: skip
    every = [p for trio in ports for p in trio]
    if len(set(every)) < len(every) or not all(0 < p < 65536 for p in every):
        raise ConfigError(f"the {count} gateways' ports collide or leave 1-65535: {ports} "
                          f"(gateway i: each port + {step} i)")  # fmt: skip
    return [dataclasses.replace(gcfg, port=p, control_port=c, tokens_port=t) for p, c, t in ports]


SECRETS = ("api_key",)  # passed in the environment: a command line is anyone's to read (ps)


def gateway_secrets(gcfg: GatewayConfig) -> dict[str, str]:
    """What a gateway child gets in its environment instead of its command line."""
    return {f"PDSERVE_{k.upper()}": getattr(gcfg, k) for k in SECRETS if getattr(gcfg, k)}


def gateway_urls(gcfg: GatewayConfig, count: int) -> list[str]:
    """Where `pdserve up`'s gateways answer HTTP."""
    return [f"http://{bracket(g.host)}:{g.port}" for g in gateway_configs(gcfg, count)]


def tokenizer_model(ecfg: EngineConfig) -> str | None:
    """The model whose tokenizer a node loads (None: the embedded one). The sim engine's
    tokens are picked from the embedded tokenizer's ordinary ones (common/engine/sim.py),
    whatever --model says: its nodes, its gateways and `generate` all use that one."""
    return ecfg.model if ecfg.engine == "torch" else None
