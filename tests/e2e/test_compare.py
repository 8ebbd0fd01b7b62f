"""`pdserve compare`: configurations x rates, each on a fresh real cluster, one report."""

from __future__ import annotations

import json
import subprocess
import sys


def test_compare_runs_every_configuration_and_writes_the_report(tmp_path):
    config = {
        "workload": {
            "num_requests": 8,
            "input_len": "uniform:200:100",
            "output_len": "fixed:6",
            "burstiness": 0.5,
            "seed": 5,
            "slo": "ttft=3000,tpot=500",
        },
        "configurations": [
            {
                "name": "disagg-1P1D",
                "rates": [4, 8],
                "up": [
                    "--engine",
                    "sim",
                    "--prefill",
                    "1",
                    "--decode",
                    "1",
                    "--sim-time-scale",
                    "1",
                ],
            },
            {
                "name": "colocated",
                "rates": [8],  # one rate: each is a fresh cluster to start
                "up": [
                    "--engine",
                    "sim",
                    "--prefill",
                    "0",
                    "--decode",
                    "0",
                    "--colocated",
                    "1",
                    "--sim-time-scale",
                    "1",
                ],
            },
        ],
    }
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "compare", "--config", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["configuration"], r["rate"]) for r in summary] == [
        ("disagg-1P1D", 4),
        ("disagg-1P1D", 8),
        ("colocated", 8),
    ]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in summary)
    report = (out / "report.md").read_text()
    assert "| disagg-1P1D | 8 |" in report and "--colocated 1" in report
    for name in ("cdf.png", "vs_rate.png"):
        assert (out / name).stat().st_size > 10_000
    assert len((out / "colocated" / "rate-8" / "requests.jsonl").read_text().splitlines()) == 8
    # --only re-runs one configuration and keeps the other's rows and records as they were
    before = {(r["configuration"], r["rate"]): r for r in summary}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "compare", "--config", str(path), "--out",
         str(out), "--only", "colocated"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    merged = json.loads((out / "summary.json").read_text())
    assert [(r["configuration"], r["rate"]) for r in merged] == list(before)
    assert [r for r in merged if r["configuration"] == "disagg-1P1D"] == [
        before[("disagg-1P1D", 4)],
        before[("disagg-1P1D", 8)],
    ]
    rerun = [r for r in merged if r["configuration"] == "colocated"]
    assert all(r["completed"] == 8 for r in rerun)
    assert rerun != [before[("colocated", 8)]]  # measured anew
    assert "# earlier" in (out / "report.md").read_text()
