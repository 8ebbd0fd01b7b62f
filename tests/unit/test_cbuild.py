"""The C kernels' build (common/cbuild.py), with stand-in compilers (shell scripts that answer
as cc does): a failed build is not tried again in the process, and the cache key holds the
compiler's own expansion of -march=native, so two CPUs never share a library."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdserve.common import cbuild

# --version and -### (the driver's expansion, on stderr) as cc answers them; a compile counts
# itself in $CALLS, then fails or writes the library (empty: never loaded here)
SCRIPT = """#!/bin/sh
case "$1" in
  --version) echo "stand-in cc 1.0"; exit 0;;
  -"##"#) echo "-### $2" >> "$CALLS"; echo '{target}' >&2; exit 0;;
esac
echo compile >> "$CALLS"
{compile}
"""
FAIL = 'echo "error: the compiler broke" >&2; exit 1'
WRITE = 'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done; exit 0'


def _cc(tmp_path: Path, name: str, target: str, compile: str) -> Path:
    path = tmp_path / name
    path.write_text(SCRIPT.format(target=target, compile=compile))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def calls(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("PDSERVE_CPU_ISA", "native")
    return tmp_path / "calls"


def test_a_failed_build_is_not_tried_again_in_the_process(tmp_path, monkeypatch, calls):
    """One start asks for the library up to 4 times (the quantization choice, the load's
    dequantizer, the GGUF kernels, the fused ones): a hung compiler cost 4 x 300 s."""
    monkeypatch.setenv("CC", str(_cc(tmp_path, "broken-cc", "-march=znver4", FAIL)))
    first, again = cbuild.build(), cbuild.build()
    assert isinstance(first, str) and "the compiler broke" in first
    assert again == first
    assert calls.read_text().splitlines().count("compile") == 1


def test_two_expansions_of_march_native_are_two_libraries(tmp_path, monkeypatch, calls):
    """Where /proc/cpuinfo cannot be read, the CPU's flags keyed every CPU alike ("x86_64"):
    a library built on one CPU was loaded on another (SIGILL). The same compiler (its
    --version) expanding -march=native differently is another CPU: another library."""
    built = []
    for name, target in (("cc-zen4", "-march=znver4 -mavx512f"), ("cc-zen2", "-march=znver2")):
        monkeypatch.setenv("CC", str(_cc(tmp_path, name, target, WRITE)))
        built += [cbuild.build(), cbuild.build()]
    assert all(isinstance(b, Path) for b in built), built
    assert built[0] == built[1] and built[2] == built[3] and built[0] != built[2]
    # the expansion is asked once a compiler and process (~6 ms), the compile once (cached)
    lines = calls.read_text().splitlines()
    assert lines.count("-### -march=native") == 2 and lines.count("compile") == 2
