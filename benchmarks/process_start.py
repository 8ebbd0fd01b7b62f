"""What a pdserve process costs to start: CPU seconds (every thread, user + system) and wall
time of a torch node from exec to registered at an idle gateway, and of a gateway from exec
to serving /health, against a floor measured in the same run: a bare `python -c "import
torch"` (a node cannot start for less; a gateway never imports torch).

    .venv/bin/python -m benchmarks.process_start --repeats 5

Processes start one at a time (none competes with another), the node with the test suite's
flags (`--kv-cache-gb 0.25`, float32). `pdserve up` and the tests start hundreds of these,
so a cut here is a cut in every cluster's start. Prints one JSON object with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pdserve.common.numerics import cpu_description
from pdserve.common.wire.transport import free_port

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system time of `pid` so far: the kernel's process line sums every thread, the
    engine's loading thread and OpenMP's workers included, ended ones too."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def health(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 until both roles are there: still an answer
        return json.loads(exc.read())


def wait_until(ready: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError("the process did not come up")


def gateway(port: int, control: int) -> tuple[subprocess.Popen, float, float]:
    started = time.monotonic()
    proc = subprocess.Popen(
        [*PDSERVE, "gateway", "--port", str(port), "--control-port", str(control),
         "--tokens-port", str(free_port())],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: "nodes" in health(port))
    except BaseException:  # not left holding its ports
        proc.kill()
        proc.wait()
        raise
    return proc, time.monotonic() - started, cpu_seconds(proc.pid)


def node(port: int, control: int, node_id: str) -> tuple[float, float]:
    started = time.monotonic()
    proc = subprocess.Popen(
        [*PDSERVE, "prefill", "--node-id", node_id, "--gateway", f"tcp://127.0.0.1:{control}",
         "--metrics-port", str(free_port()), "--engine", "torch", "--dtype", "float32",
         "--kv-cache-gb", "0.25"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: node_id in health(port)["nodes"])
        return time.monotonic() - started, cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# the import's wall clock (CLOCK_MONOTONIC is one clock for every process) and CPU (every
# thread), read right after it: a node is measured alive, at its registration, so the floor
# leaves out the interpreter's teardown (it was in: a larger floor, a smaller ratio)
FLOOR = (
    "import os, time, torch; print(time.monotonic(), time.process_time(), flush=True); os._exit(0)"
)


def torch_floor() -> tuple[float, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FLOOR], check=True, capture_output=True, text=True)
    at, cpu = (float(x) for x in done.stdout.split())
    return at - started, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    runs: dict[str, list[tuple[float, float]]] = {"torch_import": [], "node": [], "gateway": []}
    for i in range(args.repeats):  # interleaved, so a drift of the host shows in each
        runs["torch_import"].append(torch_floor())
        port, control = free_port(), free_port()
        gw, wall, cpu = gateway(port, control)
        runs["gateway"].append((wall, cpu))
        try:
            runs["node"].append(node(port, control, f"start-{i}"))
        finally:
            gw.terminate()
            gw.wait(timeout=60)
    report: dict = {"cpu": cpu_description(), "repeats": args.repeats}
    for name, samples in runs.items():
        report[name] = {
            "wall_s": round(statistics.median(w for w, _ in samples), 3),
            "cpu_s": round(statistics.median(c for _, c in samples), 3),
            "cpu_s_each": [round(c, 2) for _, c in samples],
        }
    floor = report["torch_import"]["cpu_s"]
    report["node_cpu_over_torch_import"] = round(report["node"]["cpu_s"] / floor, 2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
