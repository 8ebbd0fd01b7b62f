"""`pdserve compare --config FILE --out DIR`: the same seeded workload against several cluster
configurations and rates, then one report.

The config file (YAML or JSON) holds a `workload` (the `pdserve bench` options, as keys) and
a list of `configurations`, each with a `name`, the `up` arguments that start it (shape,
scheduler, engine and its flags) and the `rates` to run. For every configuration and rate
the cluster is started fresh with `pdserve up` on free ports, the workload runs, the cluster
stops. The output folder gets one sub-folder per run (requests.jsonl, summary.json), then
summary.json, report.md (the table, the exact command lines) and plots: TTFT and ITL CDFs
per configuration at each configuration's highest rate, and goodput and p99s against rate.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.loadgen.bench import build_workload
from pdserve.loadgen.metrics import parse_slo, summarize
from pdserve.loadgen.runner import BenchConfig, run, write_results
from pdserve.loadgen.workloads import as_text

WORKLOAD_DEFAULTS: dict[str, Any] = {
    "workload": "synthetic",
    "dataset": None,
    "num_requests": 40,
    "burstiness": 1.0,
    "concurrency": 0,
    "input_len": "fixed:128",
    "output_len": "fixed:64",
    "prefix_len": 1024,
    "groups": 4,
    "time_scale": 1.0,
    "length_scale": 1.0,
    "warmup": 0,
    "slo": "",
    "seed": 0,
    # how it is sent, as `pdserve bench` takes them
    "model": None,
    "endpoint": "completions",
    "tokenizer": None,
    "stagger": 0.0,
    "fresh_connections": False,
    "no_ignore_eos": False,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="run one workload against several configurations")
    p.add_argument("--config", required=True, help="YAML or JSON file")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="re-run these configurations only, merged into --out's earlier full run (its "
        "summary.json and each run's requests.jsonl): after a change to one policy",
    )
    p.set_defaults(func=main)


def up_arg(value: Any) -> str:
    """One `up` argument as typed: YAML reads a bare on/off as a boolean (`--prefill-ahead,
    on` gave "True", which no flag takes), and every on/off flag spells them on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def load_config(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict) or not data.get("configurations"):
        raise ValueError(f"{path}: needs a 'configurations' list (and optionally 'workload')")
    for cfg in data["configurations"]:
        if not cfg.get("name") or not cfg.get("rates"):
            raise ValueError(f"{path}: every configuration needs a name and rates")
    # a misspelt key (`num_request`) was dropped, and the run measured the default unsaid
    unknown = sorted(set(data.get("workload") or {}) - set(WORKLOAD_DEFAULTS))
    if unknown:
        known = sorted(WORKLOAD_DEFAULTS)
        raise ValueError(f"{path}: unknown workload key(s) {unknown}; known: {known} "
                         "(rates go in each configuration)")  # fmt: skip
    if (data.get("workload") or {}).get("endpoint", "completions") not in ("completions", "chat"):
        raise ValueError(f"{path}: workload endpoint: completions or chat")
    return data


def workload_specs(workload: dict[str, Any], rate: float) -> list[Any]:
    """The run's requests at `rate`: text prompts for the chat endpoint, as `bench` sends."""
    specs = build_workload(argparse.Namespace(**{**workload, "rate": rate}))
    if workload["endpoint"] == "chat":
        from pdserve.common.model.tokenizer import Tokenizer

        specs = as_text(specs, Tokenizer.load(workload["tokenizer"]).decode)
    return specs


def bench_config(url: str, workload: dict[str, Any]) -> BenchConfig:
    return BenchConfig(url=url, model=workload["model"], concurrency=workload["concurrency"],
                       warmup=workload["warmup"], ignore_eos=not workload["no_ignore_eos"],
                       progress=False, endpoint=workload["endpoint"],
                       fresh_connections=workload["fresh_connections"],
                       stagger=workload["stagger"])  # fmt: skip


def start_cluster(up_args: list[str], timeout: float) -> tuple[subprocess.Popen, str, list[str]]:
    from pdserve.common.wire.transport import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        *up_args,
        "--port",
        str(port),
        "--control-port",
        str(free_port()),
        "--tokens-port",
        str(free_port()),
    ]
    # errors="replace": one byte not UTF-8 in a child's log ended the drain, and the pipe filled
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")  # fmt: skip
    up, tail = threading.Event(), collections.deque[str](maxlen=50)  # its last words

    def drain() -> None:
        # to its end: every process of the cluster writes its log into this pipe, and one
        # left unread blocked them all once full (a gateway at INFO: ~60 requests)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if "is up" in line:
                up.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if up.wait(0.5):
            return proc, f"http://127.0.0.1:{port}", cmd
    stop_cluster(proc)  # its nodes with it (a SIGKILL left them running)
    reader.join(5)  # its last lines, the ones that say why
    raise RuntimeError(f"cluster {' '.join(up_args)} did not come up:\n{''.join(tail)}")


def gateway_counts(url: str) -> dict[str, float]:
    """Re-placements by kind (`replaced_preempted`: a decode node ran out of KV and gave the
    request back) and requests shed by early rejection, from the gateway's /metrics (the
    warm-up requests included)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^pdserve:request_replacements_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    counts = {f"replaced_{kind}": float(value) for kind, value in found}
    shed = re.search(r'^pdserve:requests_total\{outcome="overloaded"\} (\S+)$', text, re.M)
    counts["shed"] = float(shed.group(1)) if shed else 0.0
    return counts


def stop_cluster(proc: subprocess.Popen) -> None:
    # SIGTERM, which `up` takes as it takes SIGINT: a SIGINT ignored where this process was
    # started (a pytest-xdist worker, `nohup`) is ignored by the child until it sets its own
    # handler, so one that never got that far ran on for the whole wait
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# a run's line on stdout, as it ends
PRINTED = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "wait_ms_max", "goodput",
           "slo_attainment", "completed", "failed", "replaced_preempted", "shed")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    data = load_config(Path(args.config))
    workload = {**WORKLOAD_DEFAULTS, **data.get("workload", {})}
    # a trace keeps its own arrival times and a closed loop sends as answers come: rows of
    # several rates would be one run each, plotted as a goodput-vs-rate curve
    if workload["workload"] == "mooncake" or workload["concurrency"] > 0:
        if any(len({float(r) for r in c["rates"]}) > 1 for c in data["configurations"]):
            raise ValueError("this workload ignores the rate (a trace's timestamps, or "
                             "--concurrency): give each configuration one rate")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = parse_slo(workload["slo"])
    results: list[dict[str, Any]] = []
    records: dict[tuple[str, float], list[Any]] = {}
    commands: list[str] = []
    only = set(args.only or ())
    names = [cfg["name"] for cfg in data["configurations"]]
    if only - set(names):
        raise ValueError(f"--only {sorted(only - set(names))}: not in {args.config} ({names})")
    kept = earlier(out, data, only, workload) if only else {}
    for cfg in data["configurations"]:
        if only and cfg["name"] not in only:  # from the earlier run
            for rate in cfg["rates"]:
                row, recs = kept[(cfg["name"], float(rate))]
                results.append(row)
                records[(cfg["name"], float(rate))] = recs
            commands.append(" ".join(["pdserve", "up", *map(up_arg, cfg["up"])]) + "  # earlier")
            continue
        for rate in cfg["rates"]:
            specs = workload_specs(workload, float(rate))
            proc, url, cmd = start_cluster([up_arg(a) for a in cfg["up"]], args.startup_timeout)
            commands.append(" ".join(["pdserve", *cmd[3:]]))
            try:
                recs = asyncio.run(run(specs, bench_config(url, workload)))
                counts = gateway_counts(url)
            finally:
                stop_cluster(proc)
            summary = summarize(recs, slo) | counts
            meta = {"configuration": cfg["name"], "rate": rate}
            write_results(out / cfg["name"] / f"rate-{rate}", recs, summary, meta)
            results.append({**meta, **summary})
            records[(cfg["name"], float(rate))] = recs
            print(json.dumps({**meta, **{k: summary[k] for k in PRINTED if k in summary}}),
                  flush=True)  # fmt: skip
    (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    inputs = {"workload": workload, "up": {c["name"]: c["up"] for c in data["configurations"]}}
    (out / INPUTS).write_text(json.dumps(inputs, indent=2) + "\n")  # what --only checks
    write_report(out, data, workload, results, commands)
    plot(out, records, results)
    return 0


def earlier(
    out: Path, data: dict[str, Any], only: set[str], workload: dict[str, Any]
) -> dict[tuple[str, float], tuple[dict[str, Any], list[Any]]]:
    """The rows and request records of an earlier run in `out`, for the configurations not
    re-run (`--only`): only of the same workload and, for each kept one, the same cluster
    (a row of another seed or `up` merged beside new ones compares nothing)."""
    path = out / "summary.json"
    if not path.exists():
        raise ValueError(f"--only merges into an earlier full run: {path} is missing")
    try:
        inputs = json.loads((out / INPUTS).read_text())
    except FileNotFoundError:  # a run recorded before its inputs were: as the config says
        print(f"--only: {out / INPUTS} is missing (an older run): its rows are taken "
              "as this workload's and these clusters', unchecked", file=sys.stderr)  # fmt: skip
        inputs = {"workload": workload, "up": {c["name"]: c["up"] for c in data["configurations"]}}
    except (OSError, ValueError) as exc:
        raise ValueError(f"--only: {out / INPUTS} is not readable: run it whole") from exc
    # defaults filled in: a run recorded before a key was known ran it at its default
    ran_wl = json.loads(json.dumps({**WORKLOAD_DEFAULTS, **inputs.get("workload", {})}))
    if ran_wl != json.loads(json.dumps({**WORKLOAD_DEFAULTS, **workload})):
        raise ValueError(f"--only: {out} was measured on another workload: run it whole")
    ran = inputs.get("up", {})
    changed = sorted(c["name"] for c in data["configurations"] if c["name"] not in only
                     and ran.get(c["name"]) != json.loads(json.dumps(c["up"])))  # fmt: skip
    if changed:
        raise ValueError(f"--only: {changed} ran with other `up` arguments: re-run them too")
    rows = {(r["configuration"], float(r["rate"])): r for r in json.loads(path.read_text())}
    kept = {}
    for cfg in data["configurations"]:
        if cfg["name"] in only:
            continue
        for rate in cfg["rates"]:
            key = (cfg["name"], float(rate))
            if key not in rows:
                raise ValueError(f"--only: {path} has no run of {key[0]} at rate {rate}")
            lines = (out / cfg["name"] / f"rate-{rate}" / "requests.jsonl").read_text()
            kept[key] = (rows[key], [Recorded(json.loads(x)) for x in lines.splitlines() if x])
    return kept


INPUTS = "inputs.json"  # the workload and each configuration's `up` arguments of a run


class Recorded:
    """A request as an earlier run wrote it (requests.jsonl): what the plots need."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.ok = bool(row["ok"])
        self.ttft = (row["ttft_ms"] or 0.0) / 1000
        self.itls = [x / 1000 for x in row["itl_ms"]]


def write_report(
    out: Path,
    data: dict[str, Any],
    workload: dict[str, Any],
    results: list[dict[str, Any]],
    commands: list[str],
) -> None:
    cols = [
        "configuration",
        "rate",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "tpot_ms_p50",
        "itl_ms_p50",
        "itl_ms_p99",
        "e2e_ms_p50",
        "request_throughput",
        "output_throughput",
        "goodput",
        "slo_attainment",
        "wait_ms_max",
        "completed",
        "failed",
        "replaced_preempted",
        "shed",
    ]
    lines = [
        "# pdserve comparison",
        "",
        f"Workload: `{json.dumps(workload)}`",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r.get(c)) for c in cols) + " |" for r in results]
    lines += ["", "Commands (one cluster per row, started fresh):", "", "```"]
    lines += [
        *commands,
        "```",
        "",
        "![TTFT and ITL CDFs](cdf.png)",
        "",
        "![Goodput and p99s against rate](vs_rate.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def plot(
    out: Path, records: dict[tuple[str, float], list[Any]], results: list[dict[str, Any]]
) -> None:
    """`records`: RequestRecords, or `Recorded` ones from an earlier run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(name for name, _ in records))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        top = max(rate for n, rate in records if n == name)
        recs = [r for r in records[(name, top)] if r.ok]
        for ax, values in (
            (axes[0], [r.ttft * 1000 for r in recs]),
            (axes[1], [x * 1000 for r in recs for x in r.itls]),
        ):
            if values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{name} @ {top}/s")
    for ax, title in zip(axes, ("TTFT (ms)", "ITL (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if title.startswith("TTFT") else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "cdf.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in names:
        rows = sorted((r for r in results if r["configuration"] == name), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        for ax, key in zip(axes, ("goodput", "ttft_ms_p99", "itl_ms_p99"), strict=True):
            ax.plot(rates, [r[key] for r in rows], marker="o", label=name)
    for ax, key in zip(axes, ("goodput (req/s)", "TTFT p99 (ms)", "ITL p99 (ms)"), strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "vs_rate.png", dpi=110)
    plt.close(fig)
