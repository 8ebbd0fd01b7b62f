"""Several gateways, measured (docs/results/README.md, "Several gateways").

scaling: a simulated 8P8D cluster (H100 x Llama-3.1-8B, `--sim-time-scale 4`) replaying the
    Mooncake FAST'25 trace with 1, 2, 4 and 8 gateways, the clients spread over them in
    turn: the prefix-cache hit rate (prompt tokens found in the prefill nodes' caches), the
    goodput under the SLOs, and gateway CPU seconds per request (every gateway process's
    user + system time over the run), each against the one-gateway run; and, for each count
    n > 1, one gateway at 1/n of the rate (the load each of the n carries), to tell what
    several gateways cost from what a gateway costs at a lower load.
kill: a simulated 2P2D cluster with 2 gateways and 300 streams, half through each; once
    every stream runs, one gateway is SIGKILLed. Streams on the other must all complete with
    exact text and no re-placement; the dead gateway's resumable streams resume on the
    other (loadgen/resumable.py) and complete with exact text; a tenth of them do not
    resume, and the nodes free their KV within heartbeat timeout + orphan grace.

    python -m benchmarks.gateways --out docs/results/gateways            # both
    python -m benchmarks.gateways --out DIR --study scaling --counts 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.common.engine.sim import FIRST_ORDINARY_TOKEN, ORDINARY_TOKEN_SPAN
from pdserve.common.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.common.sampling import counter_int
from pdserve.launch import GATEWAY_PORT_STRIDE, wait_healthy
from pdserve.loadgen import workloads
from pdserve.loadgen.metrics import parse_slo, summarize
from pdserve.loadgen.resumable import StreamLost, resumable_chunks
from pdserve.loadgen.runner import BenchConfig, run

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_synthetic_trace.jsonl"
SLO = "ttft=2000,tpot=100"
IDLE_S = 10.0


def _base_port(gateways: int) -> int:
    """A port p with p..p+2 free for every gateway i at p + GATEWAY_PORT_STRIDE * i."""
    for base in range(21000, 60000, 97):
        ports = [base + GATEWAY_PORT_STRIDE * i + k for i in range(gateways) for k in range(3)]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _up(gateways: int, args: list[str]) -> tuple[subprocess.Popen, list[str]]:
    base = _base_port(gateways)
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "up", *args,
           "--gateways", str(gateways), "--port", str(base), "--control-port", str(base + 1),
           "--tokens-port", str(base + 2)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    urls = [f"http://127.0.0.1:{base + GATEWAY_PORT_STRIDE * i}" for i in range(gateways)]
    nodes = sum(int(args[args.index(f"--{r}") + 1]) for r in ("prefill", "decode"))
    try:
        for url in urls:
            wait_healthy(url, [proc], 300, nodes=nodes)
    except BaseException:  # its own session: nothing else would ever stop its 16 nodes
        _down(proc)
        raise
    return proc, urls


def _down(proc: subprocess.Popen) -> None:
    """Stop a cluster of `_up` (its process group): SIGTERM, SIGKILL after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _argvs() -> dict[int, list[bytes]]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return found


def _gateway_pids(ports: list[int]) -> list[int]:
    """The gateway processes of `pdserve up`, by their --port."""
    return [pid for pid, argv in _argvs().items() if b"gateway" in argv and b"--port" in argv
            and int(argv[argv.index(b"--port") + 1]) in ports]  # fmt: skip


def _node_pids(control_port: int) -> list[int]:
    """The node processes of `pdserve up` (each names every gateway in its --gateway)."""
    mine = f":{control_port}".encode()
    found = []
    for pid, argv in _argvs().items():
        if b"--gateway" in argv:
            if any(a.endswith(mine) for a in argv[argv.index(b"--gateway") + 1].split(b",")):
                found.append(pid)
    return found


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and all(
            f'{k}="{v}"' in head for k, v in labels.items()
        ):
            total += float(value)
    return total


def _summed(urls: list[str], name: str, **labels: str) -> float:
    return sum(_metric(url, name, **labels) for url in urls)


# node messages every gateway counts (pdserve:node_messages_total), per request
COUNTED = ("TokenBatch", "Heartbeat")


def _measure(n: int, specs: list[workloads.RequestSpec]) -> dict[str, Any]:
    """One `pdserve up` with `n` gateways replaying `specs`, clients spread over them."""
    args = ["--engine", "sim", "--prefill", "8", "--decode", "8", "--sim-time-scale", "4",
            "--scheduler", "kv_aware", "--max-batch", "4"]  # fmt: skip
    proc, urls = _up(n, args)
    try:
        pids = _gateway_pids([int(u.rsplit(":", 1)[1]) for u in urls])
        assert len(pids) == n, pids
        nodes = _node_pids(int(urls[0].rsplit(":", 1)[1]) + 1)  # gateway 0's control port
        assert len(nodes) == 16, nodes
        # what the gateways spend with no request at all (heartbeats and KV events of
        # 16 nodes, each to every gateway), per second, to tell it from per-request work
        idle0, node_idle0 = _cpu_s(pids), _cpu_s(nodes)
        time.sleep(IDLE_S)
        idle_rate = (_cpu_s(pids) - idle0) / IDLE_S
        node_idle_rate = (_cpu_s(nodes) - node_idle0) / IDLE_S
        queries0 = _metric(urls[0], "pdserve:cluster_prefix_cache_queries_total")
        hits0 = _metric(urls[0], "pdserve:cluster_prefix_cache_hits_total")
        msgs0 = {t: _summed(urls, "pdserve:node_messages_total", type=t) for t in COUNTED}
        # after the scrapes (2 + 2N of them: not request work); plain streams with any N, as
        # the one-gateway rows send (resumable ones make gateways and nodes keep more)
        before, started, node_before = _cpu_s(pids), time.monotonic(), _cpu_s(nodes)
        cfg = BenchConfig(url=",".join(urls), progress=False, resumable=False)
        records = asyncio.run(run(specs, cfg))
        cpu, took = _cpu_s(pids) - before, time.monotonic() - started
        node_cpu = _cpu_s(nodes) - node_before
        msgs = {t: _summed(urls, "pdserve:node_messages_total", type=t) - msgs0[t]
                for t in COUNTED}  # fmt: skip
        time.sleep(1.0)  # the nodes' next load reports carry the last prefill's counts
        queries = _metric(urls[0], "pdserve:cluster_prefix_cache_queries_total") - queries0
        hits = _metric(urls[0], "pdserve:cluster_prefix_cache_hits_total") - hits0
    finally:
        _down(proc)
    summary = summarize(records, parse_slo(SLO))
    per = max(1, len(records))
    return {
        "gateways": n, "requests": len(records), "completed": summary["completed"],
        "failed": summary["failed"], "goodput": summary["goodput"], "good": summary["good"],
        "slo_attainment": summary["slo_attainment"], "duration_s": summary["duration_s"],
        "ttft_ms_p50": summary["ttft_ms_p50"], "ttft_ms_p99": summary["ttft_ms_p99"],
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "gateway_cpu_s_per_request": round(cpu / per, 5),
        "gateway_idle_cpu_s_per_s": round(idle_rate, 4),
        "gateway_cpu_s_per_request_net_of_idle": round(max(0.0, cpu - idle_rate * took) / per, 5),
        # the 16 nodes' (sim engines: their CPU is host work, heartbeats to every gateway)
        "node_cpu_s_per_request": round(node_cpu / per, 5),
        "node_idle_cpu_s_per_s": round(node_idle_rate, 4),
        **{f"{t}_per_request": round(v / per, 2) for t, v in msgs.items()},
    }  # fmt: skip


def _stretched(specs: list[workloads.RequestSpec], factor: int) -> list[workloads.RequestSpec]:
    return [dataclasses.replace(s, arrival=s.arrival * factor) for s in specs]


def scaling(
    out: Path, counts: list[int], num_requests: int, same_load: bool = True
) -> list[dict[str, Any]]:
    """Each count of gateways on the same trace; with `same_load`, for each count n > 1 also
    one gateway at 1/n of the rate (the trace's arrival times x n): what one of the n
    gateways carries. A gateway's CPU per request follows the load it carries (at a lower
    rate a node's token batch holds fewer of its streams, and a heartbeat, a placement
    round or an event-loop wake-up serves fewer requests), so n gateways against one
    gateway at 1/n the rate isolates what several gateways cost beyond that: coordination."""
    specs = workloads.mooncake(TRACE, 3, num_requests, 0.25, 0.125)
    rows = []
    for n in counts:
        rows.append(_measure(n, specs))
        print(json.dumps(rows[-1]), flush=True)
        if same_load and n > 1:
            alone = _measure(1, _stretched(specs, n))
            rows[-1]["one_gateway_same_load"] = alone
            print(json.dumps({"one_gateway_at_rate_over": n, **alone}), flush=True)
    vs_one(rows)
    (out / "scaling.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def ratio(a: float, b: float) -> float | None:
    """a / b, or None where b is 0: a one-gateway row with no hit, no good request or no CPU
    net of idle raised ZeroDivisionError after every run, and no scaling.json was written."""
    return round(a / b, 3) if b else None


def vs_one(rows: list[dict[str, Any]]) -> None:
    """Each row's figures against the first (one gateway) row's, added to it."""
    one = rows[0]
    for row in rows:
        row["hit_rate_vs_one"] = ratio(row["prefix_hit_rate"], one["prefix_hit_rate"])
        row["goodput_vs_one"] = ratio(row["goodput"], one["goodput"])
        for key in ("gateway_cpu_s_per_request", "gateway_cpu_s_per_request_net_of_idle"):
            short = key.replace("gateway_cpu_s", "cpu")
            row[short + "_vs_one"] = ratio(row[key], one[key])
            same = row.get("one_gateway_same_load")
            if same:  # several gateways against one carrying what each of them does
                row[short + "_vs_one_same_load"] = ratio(row[key], same[key])


def _sim_text(tokenizer: Tokenizer, prompt: list[int], seed: int, n: int) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    ids = [FIRST_ORDINARY_TOKEN + counter_int(seed, len(prompt) + i, ORDINARY_TOKEN_SPAN)
           for i in range(n)]  # fmt: skip
    return "".join(detok.add(t) for t in ids)


async def _streams(urls_of: list[list[str]], bodies: list[dict], resumable: list[bool],
                   started: list[int]) -> list[str | BaseException]:  # fmt: skip
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> str:
            text, counted = "", False
            urls = urls_of[i] if resumable[i] else urls_of[i][:1]
            async for chunk in resumable_chunks(
                session,
                urls,
                "/v1/completions",
                bodies[i],
                timeout=300,
                attempts=12 if resumable[i] else 0,
            ):
                for choice in chunk.get("choices", []):
                    text += choice.get("text") or ""
                    if not counted and text:
                        counted = True
                        started[0] += 1
            return text

        return await asyncio.gather(*(one(i) for i in range(len(bodies))), return_exceptions=True)


def kill(out: Path, streams: int = 300) -> dict[str, Any]:
    timeout, grace = 1.0, 5.0
    args = ["--engine", "sim", "--prefill", "2", "--decode", "2", "--sim-time-scale", "1",
            "--node-heartbeat-timeout", str(timeout), "--orphan-grace", str(grace)]  # fmt: skip
    tokenizer = Tokenizer.load(None)
    proc, urls = _up(2, args)
    bodies: list[dict[str, Any]] = [
        {"prompt": list(range(1000 + 7 * i, 1200 + 7 * i)), "max_tokens": 300,
         "temperature": 1.0, "seed": i, "ignore_eos": True}
        for i in range(streams)
    ]  # fmt: skip
    via = [i % 2 for i in range(streams)]  # gateway 1 is killed
    urls_of = [[urls[v], urls[1 - v]] for v in via]
    resumable = [v == 0 or i % 20 != 1 for i, v in enumerate(via)]  # a tenth of gw 1's do not
    started = [0]
    results: list = []
    thread = threading.Thread(
        target=lambda: results.extend(asyncio.run(_streams(urls_of, bodies, resumable, started)))
    )
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while started[0] < streams and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = _gateway_pids([int(urls[1].rsplit(":", 1)[1])])
        os.kill(victim[0], signal.SIGKILL)
        killed = time.monotonic()
        freed_at = None
        while thread.is_alive() or freed_at is None:
            held = _metric(urls[0], "pdserve:num_requests_running") + _metric(
                urls[0], "pdserve:num_requests_waiting"
            )
            if not thread.is_alive() and held == 0 and freed_at is None:
                freed_at = time.monotonic()
            if time.monotonic() - killed > 600:
                break
            time.sleep(0.1)
        thread.join(60)
        replaced = _metric(urls[0], "pdserve:request_replacements_total")
        adopted = _metric(urls[0], "pdserve:stream_resumes_total", outcome="adopted")
    finally:
        _down(proc)
    expected = [_sim_text(tokenizer, b["prompt"], b["seed"], b["max_tokens"]) for b in bodies]
    exact = [isinstance(r, str) and r == e for r, e in zip(results, expected, strict=True)]
    groups = {
        "survivor": [i for i in range(streams) if via[i] == 0],
        "resumed": [i for i in range(streams) if via[i] == 1 and resumable[i]],
        "not_resumed": [i for i in range(streams) if via[i] == 1 and not resumable[i]],
    }
    report = {
        "streams": streams,
        "survivor_failed": sum(not exact[i] for i in groups["survivor"]),
        "survivor_streams": len(groups["survivor"]),
        "resumed_exact": sum(exact[i] for i in groups["resumed"]),
        "resumable_streams": len(groups["resumed"]),
        "resumed_exact_share": round(
            sum(exact[i] for i in groups["resumed"]) / max(1, len(groups["resumed"])), 4
        ),
        "not_resumed_failed": sum(
            isinstance(results[i], StreamLost) for i in groups["not_resumed"]
        ),
        "resume_errors": [  # the first few, for the reader
            repr(results[i])[:300] for i in groups["resumed"] if not exact[i]
        ][:5],
        "adopted": adopted,
        "replacements": replaced,
        "all_freed_after_kill_s": round(freed_at - killed, 2) if freed_at else None,
        "heartbeat_timeout_s": timeout,
        "orphan_grace_s": grace,
    }
    (out / "kill.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report), flush=True)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--study", choices=("scaling", "kill", "both"), default="both")
    p.add_argument("--counts", default="1,2,4,8")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument(
        "--no-same-load",
        action="store_true",
        help="skip one gateway at 1/n of the rate for each count n > 1",
    )
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.study in ("scaling", "both"):
        counts = [int(c) for c in args.counts.split(",")]
        scaling(out, counts, args.num_requests, not args.no_same_load)
    if args.study in ("kill", "both"):
        kill(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
