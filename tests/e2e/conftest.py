"""Real clusters for end-to-end tests: gateway and nodes as separate processes on free ports.

`make_cluster(prefill=1, decode=1, engine="torch", **flags)` starts one, waits for /health,
and returns a `Cluster`; it is stopped (SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.common.wire.transport import free_port
from pdserve.launch import stop_all, wait_healthy


@dataclass
class Cluster:
    url: str
    control: str  # the gateways' control addresses, comma-separated (what nodes are given)
    procs: list[subprocess.Popen] = field(default_factory=list)
    node_flags: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)  # every gateway's (the first is `url`)
    gateways: list[subprocess.Popen] = field(default_factory=list)

    def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 300
    ) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def get(self, path: str, at: str | None = None) -> tuple[int, str]:
        """(status, body) from the gateway at `at` (default the first); (0, reason) while
        nothing listens (e.g. a gateway restarting)."""
        try:
            with urllib.request.urlopen((at or self.url) + path, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except (urllib.error.URLError, ConnectionError) as err:
            return 0, str(err)

    def metric(self, name: str, at: str | None = None, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (gateway `at`)."""
        _, text = self.get("/metrics", at)
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head != name and not head.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def add_node(self, role: str, node_id: str, *flags: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            role,
            "--gateway",
            self.control,
            "--node-id",
            node_id,
            *self.node_flags,
            *flags,
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_all(self.procs, grace=10)


def start_cluster(
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    engine: str = "torch",
    gateway_flags: tuple[str, ...] = (),
    node_flags: tuple[str, ...] = (),
    threads: int = 1,
    extra: dict[str, tuple[str, ...]] | None = None,
    gateways: int = 1,
    each_gateway: list[tuple[str, ...]] | None = None,
) -> Cluster:
    """`extra` adds flags to single nodes by id (say, fixed ports for "decode-0");
    `gateways` > 1: that many gateways, every node registered with each; `each_gateway`:
    flags of each gateway (after `gateway_flags`), one tuple per gateway."""
    base = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO"]
    urls, controls, procs = [], [], []
    own = each_gateway or [()] * gateways
    assert len(own) == gateways, (each_gateway, gateways)
    for i in range(gateways):
        port, control, tokens = free_port(), free_port(), free_port()
        urls.append(f"http://127.0.0.1:{port}")
        controls.append(f"tcp://127.0.0.1:{control}")
        gateway = [*base, "gateway", "--port", str(port), "--control-port", str(control),
                   "--tokens-port", str(tokens), *gateway_flags, *own[i]]  # fmt: skip
        procs.append(subprocess.Popen(gateway))
    cluster = Cluster(url=urls[0], control=",".join(controls), urls=urls, gateways=procs)
    cluster.procs += procs
    # torch nodes: a 256 MiB KV cache (~5,800 tokens in float32) instead of the 1 GiB default,
    # which every node zeroes at start (page by page: seconds for four nodes on two cores);
    # a test's own --kv-cache-gb or --num-kv-blocks comes later and wins
    small_kv = ["--kv-cache-gb", "0.25"] if engine == "torch" else []
    cluster.node_flags = ["--engine", engine, "--heartbeat-interval", "0.2", *small_kv]
    cluster.node_flags += node_flags
    if engine == "torch":
        cluster.node_flags += ["--num-threads", str(threads)]
    for role, count in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
        for i in range(count):
            cmd = [
                *base,
                role,
                "--gateway",
                cluster.control,
                "--node-id",
                f"{role}-{i}",
                *cluster.node_flags,
                *(extra or {}).get(f"{role}-{i}", ()),
            ]
            cluster.procs.append(subprocess.Popen(cmd))
    try:
        for url in urls:
            wait_healthy(url, cluster.procs, timeout=180, nodes=prefill + decode + colocated)
    except Exception:
        cluster.stop()
        raise
    return cluster


@pytest.fixture
def make_cluster():
    clusters: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = start_cluster(**kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def start_up(args: list[str]) -> subprocess.Popen:
    """`pdserve up ARGS` (heartbeats every 0.2 s), its output on a text pipe: see wait_up."""
    cmd = [sys.executable, "-m", "pdserve.cli", "up", *args]
    env = {**os.environ, "PDSERVE_HEARTBEAT_INTERVAL": "0.2"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip


def wait_up(proc: subprocess.Popen, lines: list[str] | None = None) -> str:
    """Until `pdserve up` says it is up: that line (a failure if it exits first). Given
    `lines`, every line before it and after it (read on a thread) goes there."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and "is up" not in line:
        if lines is not None:
            lines.append(line)
        line = proc.stdout.readline()
    assert "is up" in line, (lines or [])[-20:]
    if lines is not None:
        out = proc.stdout
        threading.Thread(target=lambda: lines.extend(out), daemon=True).start()
    return line
