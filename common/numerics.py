"""What this CPU can do, and `--dtype auto`: which dtype this device runs best. Torch-free
(the config imports it, and the gateway imports the config).

`PDSERVE_CPU_ISA=avx2` makes the project behave as it would on an x86-64 CPU with AVX2 and
FMA only (no AVX-512, no AMX, no native bf16), so a developer on a fast CPU sees what a slow
one does: `cpu_flags()` drops the newer features (so `--dtype auto` picks float32), the fused
C kernels build for x86-64-v3 instead of the native CPU (kernels.py), and `limit_torch()`
sets PyTorch's, oneDNN's and MKL's own limits (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), which they read when first used. Unset or `native`: the CPU as it is.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# CPU features that run bfloat16 matmuls natively (x86: AVX512-BF16 or AMX; arm64: BF16).
# Without them torch emulates bf16 and prefill runs ~6x slower than in float32 (measured on a
# 2-vCPU AVX2-only AMD EPYC, benchmarks/engine.py --threads 2: 76 against 479 tok/s).
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")
ISA_ENV = "PDSERVE_CPU_ISA"
ISAS = ("native", "avx2")
# Flags an AVX2-only x86-64 CPU lacks (prefixes): AVX-512 in all its forms, AMX, and the
# VEX-encoded VNNI / bf16 conversions that came with them (oneDNN uses avx_ne_convert for bf16).
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
# x86-64-v3 (what the level builds for and tells torch): its /proc/cpuinfo flags
X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
# What PyTorch, oneDNN and MKL are told under PDSERVE_CPU_ISA=avx2.
TORCH_LIMITS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # fmt: skip


def cpu_isa() -> str:
    """The CPU level the project runs as: "native" or "avx2" (from PDSERVE_CPU_ISA). The
    level only forces a faster x86 CPU down: on one that lacks part of x86-64-v3 (a VM's
    qemu64) its code and torch's AVX2 kernels would die of SIGILL, so it runs as it is."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    if isa == "avx2" and lacks_avx2_level():
        return "native"  # said by the kernels' build (cbuild.py), once logging is set up
    return isa


def lacks_avx2_level() -> list[str]:
    """The x86-64-v3 features this x86 CPU lacks (none where the flags cannot be read, or
    on another architecture: the level is then as asked, or not an x86 one)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    raw = _raw_flags()
    return sorted(set(X86_64_V3) - raw) if raw else []


def limit_torch() -> None:
    """Under PDSERVE_CPU_ISA=avx2, set PyTorch's, oneDNN's and MKL's ISA limits in this process's
    environment (and so its children's) unless already set. They take effect when torch
    first dispatches, so call it before any tensor op (pdserve's package import does)."""
    if cpu_isa() == "avx2":
        for key, value in TORCH_LIMITS.items():
            os.environ.setdefault(key, value)


def _raw_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def limited(flags: set[str], isa: str) -> set[str]:
    """`flags` as a CPU of level `isa` would show them."""
    if isa == "native":
        return set(flags)
    return {f for f in flags if not f.startswith(_BEYOND_AVX2) and f != "bf16"}


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (x86 `flags`, arm64 `Features`), as
    PDSERVE_CPU_ISA limits them."""
    return limited(_raw_flags(), cpu_isa())


def choose_dtype(device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """`--dtype auto`: (dtype, why). CUDA: bfloat16; CPU: bfloat16 only with native bf16
    instructions, else float32."""
    if device.startswith("cuda"):
        return "bfloat16", f"{device}: GPUs run bfloat16 natively"
    have = (cpu_flags() if flags is None else flags) & set(NATIVE_BF16)
    if have:
        return "bfloat16", f"this CPU has native bfloat16 ({', '.join(sorted(have))})"
    return (
        "float32",
        "this CPU lacks native bfloat16 (no avx512_bf16/amx_bf16): bf16 prefill is ~6x slower",
    )


def cpu_description() -> str:
    """The CPU's model name and the flags that pick pdserve's paths, with the forced level if
    any: what a benchmark report names its CPU by."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    flags = ", ".join(f for f in wanted if f in cpu_flags()) or "no AVX2, AVX-512 or AMX"
    level = "" if cpu_isa() == "native" else f"; as PDSERVE_CPU_ISA={cpu_isa()}"
    return f"{name} ({flags}{level})"


def isa_level(dtype: str, flags: set[str] | None = None) -> str:
    """The CPU level a CPU engine's numbers come from, where it decides their bits: torch's,
    oneDNN's and MKL's kernels pick their code by it, and the C kernels' sums add in its
    vector order (AVX-512's 16 lanes against AVX2's 8); in bfloat16 also the native bf16
    instructions. As PDSERVE_CPU_ISA sets it (an AVX-512 CPU at avx2 is "avx2"); "" where the
    flags cannot be read (then nothing is compared)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return ""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        level = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "x86-64"
    else:
        level = machine + ("+sve" if "sve" in flags else "")
    if dtype == "bfloat16":
        level += "".join(f"+{f}" for f in NATIVE_BF16 if f in flags)
    return level


def code_path(**parts: str) -> str:
    """What computes an engine's numbers beyond its dtype and quantization, as gateways compare
    it (`path_difference`): "kernels=fused;linear=gguf-avx2;isa=avx512" (parts that are "",
    unknown, left out)."""
    return ";".join(f"{key}={value}" for key, value in parts.items() if value)


def path_difference(mine: str, theirs: str) -> str | None:
    """How two code paths differ ("kernels 'eager', not 'fused'"), None where they agree on
    every part both name: a node of an older version, or a sim engine, names none."""

    def parts(path: str) -> dict[str, str]:
        return dict(p.partition("=")[::2] for p in path.split(";") if p)

    a, b = parts(mine), parts(theirs)
    differ = [f"{key} {a[key]!r}, not {b[key]!r}" for key in a if key in b and a[key] != b[key]]
    return ", ".join(differ) or None
