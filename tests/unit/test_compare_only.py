"""`pdserve compare --only` merges re-run configurations into an earlier run's rows only when
that run measured the same workload, and the configurations kept ran the same cluster: a
row of another seed beside new ones was a comparison of two workloads, under the new
workload's heading."""

from __future__ import annotations

import json

import pytest

from pdserve.loadgen.compare import INPUTS, earlier

DATA = {"configurations": [{"name": "a", "up": ["--prefill", "1"], "rates": [4]},
                           {"name": "b", "up": ["--colocated", "1"], "rates": [4]}]}  # fmt: skip
WORKLOAD = {"workload": "synthetic", "seed": 11, "num_requests": 8}


def _earlier_run(out, workload, up):
    (out / "summary.json").write_text(json.dumps([
        {"configuration": name, "rate": 4, "goodput": 1.0} for name in ("a", "b")]))  # fmt: skip
    for name in ("a", "b"):
        (out / name / "rate-4").mkdir(parents=True)
        row = {"ok": True, "ttft_ms": 10.0, "itl_ms": [1.0], "e2e_ms": 20.0}
        (out / name / "rate-4" / "requests.jsonl").write_text(json.dumps(row) + "\n")
    (out / INPUTS).write_text(json.dumps({"workload": workload, "up": up}))


def test_only_merges_into_a_run_of_the_same_workload_and_clusters(tmp_path):
    up = {c["name"]: c["up"] for c in DATA["configurations"]}
    _earlier_run(tmp_path, WORKLOAD, up)
    kept = earlier(tmp_path, DATA, {"a"}, WORKLOAD)
    assert list(kept) == [("b", 4.0)] and kept[("b", 4.0)][0]["goodput"] == 1.0
    with pytest.raises(ValueError, match="another workload"):
        earlier(tmp_path, DATA, {"a"}, {**WORKLOAD, "seed": 12})
    other = {**up, "b": ["--colocated", "2"]}
    (tmp_path / INPUTS).write_text(json.dumps({"workload": WORKLOAD, "up": other}))
    with pytest.raises(ValueError, match=r"\['b'\] ran with other `up` arguments"):
        earlier(tmp_path, DATA, {"a"}, WORKLOAD)
    assert list(earlier(tmp_path, DATA, {"b"}, WORKLOAD)) == [("a", 4.0)]  # b re-run: fine
    (tmp_path / INPUTS).unlink()  # a run recorded before the inputs were: taken, said
    assert list(earlier(tmp_path, DATA, {"a"}, WORKLOAD)) == [("b", 4.0)]
    (tmp_path / INPUTS).write_text("{not json")
    with pytest.raises(ValueError, match="run it whole"):
        earlier(tmp_path, DATA, {"a"}, WORKLOAD)
