"""Starting processes: one node or gateway (`pdserve prefill|decode|gateway`) and the local
cluster (`pdserve up`), which runs each role as a child process and stops them all."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.errors import ConfigError
from pdserve.common.flags import from_args
from pdserve.common.ofd import sweep_dead_kv_files
from pdserve.supervisor import Child, Supervisor

if TYPE_CHECKING:
    from pdserve.common.node import NodeRuntime, RoleDefaults

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

log = logging.getLogger(__name__)


def _use_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def run_gateway(args: argparse.Namespace) -> int:
    from pdserve.gateway.app import serve

    _use_uvloop()
    serve(from_args(GatewayConfig, args))
    return 0


def run_node(args: argparse.Namespace, role: str) -> int:
    from pdserve.common.engine.llm_engine import make_engine
    from pdserve.common.memtune import tune_malloc
    from pdserve.common.model.tokenizer import Tokenizer
    from pdserve.common.node.roles import serve_roles

    tune_malloc()  # multi-megabyte KV frames reuse warm pages (see common/memtune.py)
    ecfg = from_args(EngineConfig, args)
    if ecfg.engine == "torch" and ecfg.device == "cuda:auto":
        from pdserve.common.devices import resolve_device

        ecfg = dataclasses.replace(ecfg, device=resolve_device(ecfg.device, ecfg.gpu_offset))
    ncfg = from_args(NodeConfig, args)
    tokenizer = Tokenizer.load(ecfg.model if ecfg.engine == "torch" else None)
    executor, helpers = None, None
    if ecfg.engine == "torch":  # all torch work on one engine thread (common/engine/threads.py)
        from pdserve.common.engine import threads

        idle = ecfg.engine_priority == "idle"
        executor = threads.engine_executor(ecfg.num_threads, idle)
        helpers = threads.helper_executor()
        engine = _load_unless_refused(role, ecfg, ncfg, tokenizer, executor, make_engine)
        threads.pin_threads(1)  # this thread runs the event loop
    else:
        engine = make_engine(ecfg, tokenizer.eos_token_ids)
    ids: list[str] = []

    def make(role: str) -> NodeRuntime:
        from pdserve.common.node import NodeRuntime

        # a node switched to the other role keeps its id: the gateway knows it by that
        cfg = dataclasses.replace(ncfg, node_id=ids[0]) if ids else ncfg
        node = NodeRuntime(role_class(role), cfg, ecfg, engine, tokenizer, executor=executor)
        ids.append(node.node_id)
        return node

    async def main() -> None:
        if helpers is not None:
            asyncio.get_running_loop().set_default_executor(helpers)
        await serve_roles(role, make)

    _use_uvloop()
    asyncio.run(main())
    return 0


def _load_unless_refused(role: str, ecfg: EngineConfig, ncfg: NodeConfig, tokenizer: Any,
                         executor: Any, make_engine: Any) -> Any:  # fmt: skip
    """The engine, loaded on its thread while the gateways are asked whether they would take
    it (common/node/precheck.py): a refused node leaves without waiting for its weights."""
    from pdserve.common.node import precheck
    from pdserve.common.wire.security import ClusterKey

    probe = precheck.probe_of(role, ecfg, ncfg, tokenizer.fingerprint())
    key = ClusterKey.load(ncfg.cluster_key) if ncfg.cluster_key else None  # a bad one: now
    loading = executor.submit(make_engine, ecfg, tokenizer.eos_token_ids)
    refused = asyncio.run(precheck.ask(ncfg, key, probe, loading))
    if refused is not None:
        precheck.leave(role, refused)
    return loading.result()


def role_class(role: str) -> type[RoleDefaults]:
    if role == "prefill":
        from pdserve.prefill_node.server import PrefillRole

        return PrefillRole
    if role == "decode":
        from pdserve.decode_node.server import DecodeRole

        return DecodeRole
    from pdserve.colocated_node.server import ColocatedRole

    return ColocatedRole


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


def _child_death_signal() -> None:
    """Children die with the parent, even on SIGKILL: no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float, nodes: int = 0,
                 stop: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
    """Wait for /health to answer 200 with at least `nodes` nodes registered: health turns
    green with one prefill and one decode node, and a caller that started more wants them all
    before it sends load (a scheduler comparison on half a cluster measures nothing). A
    SIGTERM or SIGINT meanwhile (`stop`) ends the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop():
            raise RuntimeError("stopped before the cluster was up")
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200 and len(json.loads(resp.read())["nodes"]) >= nodes:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the cluster did not become healthy within {timeout:.0f} s")


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
    counts = [getattr(args, r, 0) for r in ("prefill", "decode", "colocated")]
    if min(counts) < 0 or not sum(counts):
        raise ConfigError("--prefill, --decode and --colocated count nodes: >= 0, one at least")
    return gcfg, ncfg


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def cluster_commands(args: argparse.Namespace) -> list[list[str]]:
    gcfg, ncfg = up_configs(args)
    ecfg = from_args(EngineConfig, args)
    node_flags = to_flags(ncfg, skip=PER_NODE)
    nodes = args.prefill + args.decode + args.colocated
    if ecfg.engine == "torch" and not ecfg.num_threads:
        ecfg = dataclasses.replace(ecfg, num_threads=max(1, (os.cpu_count() or 2) // nodes))
    base = [sys.executable, "-m", "pdserve.cli", "--log-level", args.log_level]
    base += ["--log-format", getattr(args, "log_format", "text")]
    if ecfg.engine == "sim" and gcfg.cost_time_scale == 1.0:
        # the gateway's cost rules speak the sim engines' clock
        gcfg = dataclasses.replace(gcfg, cost_time_scale=ecfg.sim_time_scale)
    if getattr(args, "gateways", 1) < 1:
        raise ConfigError("--gateways must be at least 1")
    cmds = []
    for g in gateway_configs(gcfg, getattr(args, "gateways", 1)):
        gateway = [*base, "gateway", *to_flags(g, skip=("scheduler", *SECRETS)), "--scheduler",
                   g.scheduler]  # fmt: skip
        cmds.append([*gateway, "--model", ecfg.model] if ecfg.model else gateway)
    host = gcfg.advertise_host or "127.0.0.1"
    address = ",".join(f"tcp://{host}:{g.control_port}"
                       for g in gateway_configs(gcfg, getattr(args, "gateways", 1)))  # fmt: skip
    roles = (("prefill", args.prefill), ("decode", args.decode), ("colocated", args.colocated))
    for role, count in roles:
        threads = getattr(args, f"{role}_threads", 0)  # --prefill-threads, --decode-threads
        role_cfg = dataclasses.replace(ecfg, num_threads=threads) if threads else ecfg
        if role == "prefill" and getattr(args, "prefill_priority", "normal") == "idle":
            role_cfg = dataclasses.replace(role_cfg, engine_priority="idle")
        for i in range(count):
            node = [*base, role, "--gateway", address, "--node-id", f"{role}-{i}"]
            cmds.append([*node, *to_flags(role_cfg), *node_flags])
    return cmds


GATEWAY_PORT_STRIDE = 10  # `pdserve up --gateways N`: gateway i's ports are the first's + 10 i


def gateway_configs(gcfg: GatewayConfig, count: int) -> list[GatewayConfig]:
    """The gateways of `pdserve up --gateways N`: the same settings, each on its own ports."""
    step = GATEWAY_PORT_STRIDE
    ports = [(gcfg.port + step * i, gcfg.control_port + step * i, gcfg.tokens_port + step * i)
             for i in range(count)]  # fmt: skip
    return [dataclasses.replace(gcfg, port=p, control_port=c, tokens_port=t) for p, c, t in ports]


SECRETS = ("api_key",)  # passed in the environment: a command line is anyone's to read (ps)


def gateway_secrets(gcfg: GatewayConfig) -> dict[str, str]:
    """What a gateway child gets in its environment instead of its command line."""
    return {f"PDSERVE_{k.upper()}": getattr(gcfg, k) for k in SECRETS if getattr(gcfg, k)}


CONFIGS = (EngineConfig, GatewayConfig, NodeConfig)
CONFIG_ENV = frozenset(f"PDSERVE_{f.name.upper()}" for c in CONFIGS for f in dataclasses.fields(c))


def _spawn(
    child: Child,
    nice: int = 0,
    env: dict[str, str] | None = None,
    secrets: dict[str, str] | None = None,
) -> subprocess.Popen:
    def before_exec() -> None:
        _child_death_signal()
        if nice:
            os.nice(nice)

    # the configuration's PDSERVE_* variables are `up`'s, resolved into each child's flags:
    # inherited, they would override a flag left out as a default, and give every node the
    # same per-node port
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in CONFIG_ENV}
    return subprocess.Popen(child.command, preexec_fn=before_exec, env={**env, **(secrets or {})})


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def node_spawn_options(args: argparse.Namespace, commands: list[list[str]]) -> dict[str, Any]:
    """Per node: its niceness (--prefill-nice, --decode-nice) and environment. When the torch
    threads that compete as equals outnumber the cores, their OpenMP threads stop spinning
    (OMP_WAIT_POLICY and GOMP_SPINCOUNT, unless either is set): a thread spinning between
    parallel regions holds a core that another node's thread needs, and a team with one
    thread descheduled stalls at every barrier (measured on 2 cores, 1P1D with 2 threads
    each: ITL p99 490 ms spinning for libgomp's default ~3 ms, 115 ms passive). Prefill
    nodes then wait passively: their regions are long matmuls. Decode nodes spin for
    `--decode-spin` iterations (~30 us) where their own threads fit the cores: a decode step
    is ~150 short regions microseconds apart, and waking a sleeping thread for each cost a
    batch-1 step +24-35 % (a 2-vCPU Xeon at the AVX2 level). ~0.1 ms spun through the
    event loop's and the prefill node's turns as well (an EPYC Zen 4: 16 lock-step
    streams' ITL p99 +50 % against passive), ~10 us left a batch-1 1P1D step +22 % over
    the engine's (AVX2 level); ~30 us: +9 %, at passive's tail. Between steps the threads
    still sleep. An idle engine (--engine-priority idle, set by --prefill-priority idle)
    takes no core from the others, so they keep libgomp's default (its own threads wait
    passively): measured, 1P1D with 16 streams in lock-step, ITL p99 84 ms with a passive
    decode node, 50 ms with a spinning one."""
    nodes = {c[c.index("--node-id") + 1]: c for c in commands if "--node-id" in c}
    idle = {n: _flag(c, "--engine-priority") == "idle" for n, c in nodes.items()}
    threads = {n: int(_flag(c, "--num-threads") or 0) for n, c in nodes.items()}
    busy = sum(t for n, t in threads.items() if not idle[n])
    decoding = sum(t for n, t in threads.items() if not idle[n] and _role(n) == "decode")
    cores = os.cpu_count() or 1
    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    spin = getattr(args, "decode_spin", 0)
    out = {}
    for name in nodes:
        crowd = sum(threads.values()) if idle[name] else busy
        env = None
        if crowd > cores and not chosen:
            if _role(name) == "decode" and spin > 0 and decoding <= cores:
                env = {**os.environ, "GOMP_SPINCOUNT": str(spin)}
            else:
                env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
        out[name] = {"nice": getattr(args, f"{_role(name)}_nice", 0), "env": env}
    return out


def _role(node_id: str) -> str:
    return node_id.split("-")[0]


def run_up(args: argparse.Namespace) -> int:
    """Start the cluster, wait until every node registered, then supervise it: a child that
    dies is restarted and the others keep serving (pdserve/supervisor.py). A child that fails
    before the cluster is up is a configuration error and stops everything."""
    gcfg, _ = up_configs(args)
    gateways = getattr(args, "gateways", 1)
    urls = [f"http://{g.host}:{g.port}" for g in gateway_configs(gcfg, gateways)]
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    commands = cluster_commands(args)
    names = [f"gateway-{i}" if gateways > 1 else "gateway" for i in range(gateways)]
    children = [Child(names[i], cmd) for i, cmd in enumerate(commands[:gateways])]
    for child in children:
        child.essential = True  # the cluster serves while one gateway does
    children += [Child(cmd[cmd.index("--node-id") + 1], cmd) for cmd in commands[gateways:]]
    options = node_spawn_options(args, [c.command for c in children])
    options.update({name: {"secrets": gateway_secrets(gcfg)} for name in names})
    supervisor = Supervisor(children, lambda c: _spawn(c, **options.get(c.name, {})))
    try:
        supervisor.start(time.monotonic())
        procs = list(supervisor.running())
        for url in urls:
            wait_healthy(url, procs, args.startup_timeout, len(procs) - gateways, lambda: stop)
        body = json.dumps(
            {"messages": [{"role": "user", "content": "Hello!"}], "stream": True, "max_tokens": 32}
        )
        shape = f"{args.prefill} prefill, {args.decode} decode, {args.colocated} colocated"
        print(f"pdserve is up at {' '.join(urls)} ({shape})", flush=True)
        curl = f"curl -N {urls[0]}/v1/chat/completions -H 'Content-Type: application/json'"
        print(f"  {curl} -d '{body}'", flush=True)
        code = supervisor.run(lambda: stop)
        if code:
            print("pdserve up: the cluster cannot go on; stopping", file=sys.stderr)
        return code
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all([c.proc for c in children if c.proc is not None])
        sweep_dead_kv_files()  # a node killed mid-drain or mid-load leaves its KV cache file


def stop_all(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every child (nodes drain), then SIGKILL what is left after `grace`."""
    for p in reversed(procs):  # nodes first, the gateway last
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
