"""The llama-server comparison's plumbing (benchmarks/): where the binary comes from, and the
report's ratios against the targets. The comparison itself is a benchmark, not a test."""

from __future__ import annotations

import argparse
import sys

from benchmarks import llama_server, vs_llama


def test_an_explicit_binary_wins_and_a_missing_one_says_why(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("LLAMA_SERVER", str(fake))
    assert llama_server.find_or_build(build=False) == fake
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nothing"))
    found = llama_server.find_or_build(build=False)
    assert isinstance(found, str) and "not a file" in found


def test_without_a_build_and_with_none_found_it_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    monkeypatch.setattr(llama_server, "CACHE", tmp_path / "cache")
    found = llama_server.find_or_build(build=False)
    assert isinstance(found, str) and "LLAMA_SERVER" in found
    build = tmp_path / "cache" / "1.0" / "llama.cpp" / "build" / "bin"
    build.mkdir(parents=True)
    (build / "llama-server").write_text("")
    assert llama_server.find_or_build(build=False) == build / "llama-server"  # the cache


def test_the_report_gives_ratios_to_llama_server_and_says_met_or_not():
    row = dict.fromkeys(vs_llama.KEYS, 0.0)
    ref = {"1": {**row, "output_throughput": 60.0}, "16": {**row, "output_throughput": 90.0,
           "itl_ms_p99": 100.0}}  # fmt: skip
    ours = {"1": {**row, "output_throughput": 50.0}, "16": {**row, "output_throughput": 120.0}}
    split = {"16": {**row, "itl_ms_p99": 60.0}}
    args = argparse.Namespace(threads=2, prompt=256, output=128, dtype="auto", quantization="auto")
    text = vs_llama.report({"llama-server": ref, "colocated": ours, "1p1d": split}, args)
    assert "colocated output_throughput at 16 streams: 1.33x (target >= 1.0x): met" in text
    assert "colocated output_throughput at 1 streams: 0.83x (target >= 0.8x): met" in text
    assert "1p1d itl_ms_p99 at 16 streams: 0.60x (target <= 0.5x): NOT met" in text
    assert "16 staggered" not in text  # cases not run are left out, not invented
    # a side whose requests all failed has no figure: said, not a crash losing the report
    failed = {"16": {**row, "itl_ms_p99": None}}
    text = vs_llama.report({"llama-server": ref, "1p1d": failed}, args)
    assert "1p1d itl_ms_p99 at 16 streams: n/a (target <= 0.5x)" in text


FAKE_SERVER = """#!/bin/sh
# a stand-in llama-server: dies by SIGSEGV as llama.cpp's AMX path does on some CPUs, unless
# started with --no-repack; then answers /health (a file named health) on its --port
port=0; repack=1
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift ;; --no-repack) repack=0 ;; esac; shift
done
echo "args: $port $repack"
[ "$repack" = 1 ] && kill -SEGV $$
cd "$(dirname "$0")/www" && exec {python} -m http.server "$port" --bind 127.0.0.1
"""


def test_a_server_that_crashes_on_start_is_restarted_without_repacking(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    from pdserve.common.wire.transport import free_port

    log = tmp_path / "server.log"
    proc, flags = llama_server.start(fake, tmp_path / "m.gguf", free_port(), 2, 4, 128, log)
    try:
        assert flags == ["--no-repack"]
        assert proc.poll() is None
        assert (tmp_path / "server.crashed.log").read_text().strip().endswith(" 1")  # repacking
    finally:
        llama_server.stop(proc)
    args = argparse.Namespace(threads=2, prompt=256, output=128, dtype="auto", quantization="auto")
    args.llama_note = f"llama-server: {llama_server.NO_REPACK_WHY}."
    assert "--no-repack" in vs_llama.report({}, args)
