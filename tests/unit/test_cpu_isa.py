"""PDSERVE_CPU_ISA: the project behaves as an AVX2-only x86-64 CPU on any CPU (numerics.py):
the flags it sees, the dtype `auto` picks, the C kernels' target, and PyTorch's and oneDNN's
limits. The last test checks that the running process honours the level it was started with,
so `make test-cpu-variants`' second run cannot silently run native."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pdserve.common.engine import kernels
from pdserve.common.numerics import choose_dtype, cpu_flags, cpu_isa, limited

pytestmark = pytest.mark.cpu
X86 = platform.machine().lower() in ("x86_64", "amd64")
# a Xeon with AMX: what it shows, and what an AVX2-only CPU shows of it
XEON = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
        "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8", "avx_vnni"}  # fmt: skip


def test_avx2_level_drops_avx512_amx_and_native_bf16():
    assert limited(XEON, "native") == XEON
    assert limited(XEON, "avx2") == {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert choose_dtype("cpu", limited(XEON, "native"))[0] == "bfloat16"
    assert choose_dtype("cpu", limited(XEON, "avx2"))[0] == "float32"
    assert limited({"asimd", "bf16"}, "avx2") == {"asimd"}  # arm64's bf16 is dropped too


def test_a_wrong_level_is_an_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA"):
        cpu_isa()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "")
    assert cpu_isa() == "native"


def test_the_kernels_target_the_level(monkeypatch):
    from pdserve.common import numerics

    monkeypatch.setenv("PDSERVE_CPU_ISA", "native")
    assert kernels.compile_flags()[0] == "-march=native"
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    monkeypatch.setattr(numerics, "_raw_flags", lambda: set(numerics.X86_64_V3))  # a v3 CPU
    assert kernels.compile_flags()[0] == ("-march=x86-64-v3" if X86 else "-march=native")


@pytest.mark.skipif(not X86, reason="the forced-down level is an x86 level")
def test_the_level_never_forces_a_cpu_above_itself(monkeypatch):
    """On a CPU without part of x86-64-v3 (a VM's qemu64; one that masks BMI2) the v3 build
    loaded and died of SIGILL at the first kernel call, and torch was told AVX2: the level
    only forces a faster CPU down. Flags that cannot be read: as asked."""
    from pdserve.common import numerics

    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    v3 = set(numerics.X86_64_V3)
    for raw in ({"sse2", "sse4_2", "avx"}, v3 - {"bmi2"}):
        monkeypatch.setattr(numerics, "_raw_flags", lambda raw=raw: raw)
        assert cpu_isa() == "native" and kernels.compile_flags()[0] == "-march=native"
    monkeypatch.setattr(numerics, "_raw_flags", lambda: v3 | {"avx512f"})
    assert cpu_isa() == "avx2" and kernels.compile_flags()[0] == "-march=x86-64-v3"
    monkeypatch.setattr(numerics, "_raw_flags", set)
    assert cpu_isa() == "avx2"


def test_the_package_import_limits_torch_in_a_new_process():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    code = (
        "import pdserve, os, torch; print(os.environ.get('ATEN_CPU_CAPABILITY'), "
        "os.environ.get('ONEDNN_MAX_CPU_ISA'), torch.backends.cpu.get_cpu_capability())"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PDSERVE_CPU_ISA": "avx2"},
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    from pdserve.common.numerics import X86_64_V3, _raw_flags

    if X86 and not set(X86_64_V3) <= _raw_flags():  # the level never forces a CPU up
        assert out[:2] == ["None", "None"]
        return
    assert out[:2] == ["avx2", "AVX2"]
    if X86:
        assert out[2] in ("AVX2", "DEFAULT")  # never AVX512 once limited


def test_this_process_runs_at_its_level():
    """What the suite runs as: at the avx2 level, float32 by `auto`, torch's kernels at most
    AVX2, no oneDNN bf16, and no flag beyond AVX2 seen."""
    if cpu_isa() != "avx2":
        assert cpu_flags() == limited(cpu_flags(), "native")
        return
    assert choose_dtype("cpu")[0] == "float32"
    assert not {f for f in cpu_flags() if f.startswith(("avx512", "amx"))}
    if X86:
        assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
