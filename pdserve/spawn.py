"""How `pdserve up` starts its children: the cores it may use, each node's niceness, OpenMP
waiting and environment, a session of its own, and death with its parent."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
from typing import Any

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.errors import EXIT_REFUSED
from pdserve.supervisor import Child


def cores() -> int:
    """The cores this process may run on (taskset, a container's cpuset): cpu_count() is
    the host's, and 8 threads a node on 2 allowed cores oversubscribed them 4x."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _child_death_signal(parent: int) -> None:
    """Children die with the parent, even on SIGKILL: no orphans. A parent gone before the
    signal was set (between fork and prctl) is seen by its pid."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:
        os._exit(1)


CONFIGS = (EngineConfig, GatewayConfig, NodeConfig)
CONFIG_ENV = frozenset(f"PDSERVE_{f.name.upper()}" for c in CONFIGS for f in dataclasses.fields(c))


def spawn(
    child: Child,
    nice: int = 0,
    env: dict[str, str] | None = None,
    secrets: dict[str, str] | None = None,
) -> subprocess.Popen:
    parent = os.getpid()

    def before_exec() -> None:
        _child_death_signal(parent)
        if nice:
            try:
                os.nice(nice)
            except PermissionError:  # a negative niceness without CAP_SYS_NICE: said, not
                # a traceback of "Exception occurred in preexec_fn"; no restart can help
                os.write(2, f"pdserve up: {child.name}: niceness {nice} is not permitted "
                         "here (lowering it needs root or CAP_SYS_NICE)\n".encode())  # fmt: skip
                os._exit(EXIT_REFUSED)

    # the configuration's PDSERVE_* variables are `up`'s, resolved into each child's flags:
    # inherited, they would override a flag left out as a default, and give every node the
    # same per-node port
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in CONFIG_ENV}
    # a session of its own: a terminal's Ctrl-C reached every node and began its drain, and
    # `up`'s SIGTERM 0.2 s later was its second signal (stop now): no drain ever happened
    return subprocess.Popen(child.command, preexec_fn=before_exec, start_new_session=True,
                            env={**env, **(secrets or {})})  # fmt: skip


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
    allowed = cores()
    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    spin = getattr(args, "decode_spin", 0)
    out = {}
    for name in nodes:
        crowd = sum(threads.values()) if idle[name] else busy
        env = None
        if crowd > allowed and not chosen:
            if _role(name) == "decode" and spin > 0 and decoding <= allowed:
                env = {**os.environ, "GOMP_SPINCOUNT": str(spin)}
            else:
                env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
        out[name] = {"nice": getattr(args, f"{_role(name)}_nice", 0), "env": env}
    return out


def _role(node_id: str) -> str:
    return node_id.split("-")[0]
