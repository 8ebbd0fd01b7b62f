"""Starting processes: one node or gateway (`pdserve prefill|decode|gateway`) and the local
cluster (`pdserve up`), which runs each role as a child process and stops them all."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.errors import EXIT_REFUSED, ConfigError
from pdserve.common.flags import from_args
from pdserve.common.ofd import sweep_dead_kv_files
from pdserve.ports import metrics_ports_free, node_ports_free, ports_free
from pdserve.spawn import node_spawn_options
from pdserve.spawn import spawn as _spawn
from pdserve.supervisor import Child, Supervisor
from pdserve.up_commands import GATEWAY_PORT_STRIDE as GATEWAY_PORT_STRIDE  # benchmarks'
from pdserve.up_commands import (
    cluster_commands,
    gateway_configs,
    gateway_secrets,
    gateway_urls,
    tokenizer_model,
    up_configs,
)

if TYPE_CHECKING:
    from pdserve.common.node import NodeRuntime, RoleDefaults

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
    cfg = from_args(GatewayConfig, args)
    ports_free([cfg])  # a taken port: its flag named, not a bind's traceback
    serve(cfg)
    return 0


def run_node(args: argparse.Namespace, role: str) -> int:
    from pdserve.common.engine.llm_engine import make_engine
    from pdserve.common.memtune import tune_malloc
    from pdserve.common.model.tokenizer import Tokenizer
    from pdserve.common.node.control import RegistrationRefused
    from pdserve.common.node.roles import serve_roles

    tune_malloc()  # multi-megabyte KV frames reuse warm pages (see common/memtune.py)
    ecfg = from_args(EngineConfig, args)
    if ecfg.engine == "torch" and ecfg.device == "cuda:auto":
        from pdserve.common.devices import resolve_device

        ecfg = dataclasses.replace(ecfg, device=resolve_device(ecfg.device, ecfg.gpu_offset))
    ncfg = from_args(NodeConfig, args)
    node_ports_free(ncfg, role)  # before the model loads (minutes), not after
    tokenizer = Tokenizer.load(tokenizer_model(ecfg))
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
    try:
        asyncio.run(main())
    except RegistrationRefused as exc:  # the same at every start: not restarted (supervisor.py)
        print(f"pdserve {role}: error: refused by a gateway: {exc}", file=sys.stderr)
        return EXIT_REFUSED
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
        health = read_health(url, 1.0)
        if health is not None and health[0] == 200 and "nodes" in health[1]:
            if len(health[1]["nodes"]) >= nodes:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the cluster did not become healthy within {timeout:.0f} s")


def read_health(url: str, timeout: float) -> tuple[int, dict[str, Any]] | None:
    """A gateway's /health: its status and JSON ({} when not a JSON object), or None when
    nothing answers in HTTP (down, cut short, another protocol): never an exception."""
    try:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:  # 503 until both roles are there: an answer
            status, body = exc.code, exc.read()
    except Exception:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    return status, parsed if isinstance(parsed, dict) else {}


def run_up(args: argparse.Namespace) -> int:
    """Start the cluster, wait until every node registered, then supervise it: a child that
    dies is restarted and the others keep serving (pdserve/supervisor.py). A child that fails
    before the cluster is up is a configuration error and stops everything."""
    gcfg, ncfg = up_configs(args)
    hung_after = hung_limit(getattr(args, "restart_hung_after", None), gcfg, ncfg)
    gateways = getattr(args, "gateways", 1)
    urls = gateway_urls(gcfg, gateways)
    stop = 0  # signals received: the first drains the cluster, a second stops it now

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop += 1

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ports_free(gateway_configs(gcfg, gateways))  # before the kernels' build and measurement
    nodes = args.prefill + args.decode + args.colocated
    metrics_ports_free(ncfg.metrics_host, getattr(args, "node_metrics_port", 0), nodes)
    commands = cluster_commands(args)
    names = [f"gateway-{i}" if gateways > 1 else "gateway" for i in range(gateways)]
    children = [Child(names[i], cmd) for i, cmd in enumerate(commands[:gateways])]
    for child in children:
        child.essential = True  # the cluster serves while one gateway does
    for cmd in commands[gateways:]:
        name = cmd[cmd.index("--node-id") + 1]
        role = cmd[cmd.index("--gateway") - 1]  # the subcommand: prefill, decode, colocated
        serves: tuple[str, ...] = ("prefill", "decode") if role == "colocated" else (role,)
        if gcfg.role_switching == "on":  # a node's phase is the gateway's to change: the
            serves = ("prefill", "decode")  # rule fires once every node is gone
        children.append(Child(name, cmd, serves=serves))
    options = node_spawn_options(args, [c.command for c in children])
    options.update({name: {"secrets": gateway_secrets(gcfg)} for name in names})
    ready = Readiness(names, urls, gcfg.heartbeat_timeout + 1.0)
    supervisor = Supervisor(
        children,
        lambda c: _spawn(c, **options.get(c.name, {})),
        is_ready=ready,
        hung_after=hung_after,
    )
    try:
        if stop:  # a signal while the ports were checked or the kernels built
            return 1
        supervisor.start(time.monotonic())
        procs = list(supervisor.running())
        for url in urls:
            wait_healthy(url, procs, args.startup_timeout, len(procs) - gateways, lambda: stop > 0)
        body = json.dumps(
            {"messages": [{"role": "user", "content": "Hello!"}], "stream": True, "max_tokens": 32}
        )
        shape = f"{args.prefill} prefill, {args.decode} decode, {args.colocated} colocated"
        print(f"pdserve is up at {' '.join(urls)} ({shape})", flush=True)
        curl = f"curl -N {urls[0]}/v1/chat/completions -H 'Content-Type: application/json'"
        print(f"  {curl} -d '{body}'", flush=True)
        code = supervisor.run(lambda: stop > 0)
        if code:
            print("pdserve up: the cluster cannot go on; stopping", file=sys.stderr)
        return code
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        # the nodes' drain (and its hand-back) first, then the gateways streaming the last
        # tokens; a signal more (Ctrl-C, SIGTERM) ends it at once. With no gateway left, a
        # drain has nowhere to move or hand back to: the plain grace
        signalled = min(stop, 1)  # two at once: the second hurries it
        serving = any(c.proc is not None and c.proc.poll() is None for c in children[:gateways])
        drain = ncfg.drain_timeout + 5.0 if serving else 10.0
        procs = [c.proc for c in children if c.proc is not None]
        stop_all(procs[gateways:], drain, hurry=lambda: stop > signalled)
        stop_all(procs[:gateways], hurry=lambda: stop > signalled)
        sweep_dead_kv_files()  # a node killed mid-drain or mid-load leaves its KV cache file


def hung_limit(given: float | None, gcfg: GatewayConfig, ncfg: NodeConfig) -> float:
    """--restart-hung-after: 0 (never) or more than a drop and a registration again (else a
    healthy node re-registering is killed); default 60 s. Never shorter than a drain: a
    draining node a restarted gateway refused stays unlisted until it ends."""
    floor = gcfg.heartbeat_timeout + 1.0
    if given is None:
        given = max(60.0, 2 * floor)
    elif not (given == 0 or floor < given < math.inf):
        raise ConfigError(f"--restart-hung-after: 0 (never) or more than the gateways' "
                          f"--heartbeat-timeout + 1 s ({floor:g})")  # fmt: skip
    return max(given, ncfg.drain_timeout + floor) if given else 0.0


class Readiness:
    """Which children serve, for the supervisor: a gateway that answers /health, a node that
    one of them lists as registered. Read at most once a second."""

    def __init__(self, names: list[str], urls: list[str], stale: float) -> None:
        self.gateways = list(zip(names, urls, strict=True))
        self.up: set[str] = set()
        self.answered = False  # whether a gateway could tell at the last read
        self.since: dict[str, float] = {}  # gateway -> answering since
        self.read_at = -1e9
        self.stale = stale  # how long a gateway may list a node that died (its timeout)

    def __call__(self, child: Child) -> bool | None:
        now = time.monotonic()
        if now - self.read_at >= 1.0:
            self.read_at, (self.up, self.answered) = now, self._read(now)
        if child.name not in self.up:  # unlisted: a node only when a gateway can tell
            return False if self.answered or not child.serves else None
        # a listing older than a restart's node plus the gateways' timeout may be the dead
        # one's: its load would then count as serving
        return True if self.read_at >= child.started + self.stale else None

    def _read(self, now: float) -> tuple[set[str], bool]:
        """Who is listed, and whether a gateway can tell a node that is not: one answering
        with its node list for `stale` seconds (a restarted gateway lists none until the
        nodes register again, a heartbeat timeout later)."""
        up: set[str] = set()
        answered = False
        for name, url in self.gateways:
            health = read_health(url, 0.5)
            if health is None or not isinstance(health[1].get("nodes"), dict):
                self.since.pop(name, None)
                continue
            up |= {name, *health[1]["nodes"]}
            answered |= now - self.since.setdefault(name, now) >= self.stale
        return up, answered


def stop_all(procs: list[subprocess.Popen], grace: float = 10.0,
             hurry: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
    """SIGTERM every child (nodes drain), then SIGKILL what is left after `grace`, or at
    once when `hurry` says so."""
    for p in reversed(procs):  # nodes first, the gateway last
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
