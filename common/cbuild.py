"""Compiling the project's C kernels (common/engine/cpu_kernels.c and gguf_matmul.c) into one
library for the CPU that runs them, cached by a hash of the sources, the compiler, its flags,
what the compiler makes of `-march` on this CPU, and the CPU's flags. torch-free: the config
resolving `--quantization auto` keys its cached measurement by this build, in processes that
never load the engine (common/engine/kernels.py loads the library).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.common.numerics import ISA_ENV, cpu_flags, cpu_isa, lacks_avx2_level

log = logging.getLogger(__name__)
_said: list[bool] = []  # a level above the CPU is said once a process
# builds that failed in this process, by compiler, flags and cache: not tried again (one start
# asks up to 4 times: a hung compiler cost 4 x 300 s, and its warnings came 4 times)
_failed: dict[tuple[str, ...], str] = {}
ENGINE = Path(__file__).resolve().parent / "engine"
SOURCE = ENGINE / "cpu_kernels.c"  # absolute: it includes itself
SOURCES = (SOURCE, ENGINE / "gguf_matmul.c")  # one library
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
# The CPU the code is built for: this one, or under PDSERVE_CPU_ISA=avx2 the x86-64-v3 level
# (AVX2, FMA, BMI2: what an AVX2-only EPYC has), so a fast CPU runs a slow one's code.
MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3"}


def _cpu_flags() -> str:
    return " ".join(sorted(cpu_flags())) or platform.processor()


@functools.cache
def target(cc: str, march: str) -> str:
    """What `march` means to this compiler here: its driver's expansion (`cc -###`: the
    -march=CPU, -m features and cache sizes it would hand cc1, ~6 ms), so a library built for
    one CPU is never taken for another's. The CPU's flags alone did not tell them apart where
    /proc/cpuinfo is unreadable (every CPU keyed as "x86_64": SIGILL on the next one). "" where
    the compiler does not say (then those flags key it alone, as before)."""
    try:
        done = subprocess.run([cc, "-###", march, "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stderr if done.returncode == 0 else ""


def compile_flags() -> list[str]:
    """The compiler's flags for the CPU level the project runs as (numerics.cpu_isa)."""
    isa = cpu_isa()
    if isa != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        isa = "native"  # the forced-down levels are x86 levels; elsewhere the CPU as it is
    lacks = lacks_avx2_level() if os.environ.get(ISA_ENV, "").strip().lower() == "avx2" else []
    if lacks and not _said:  # the level asked for is above this CPU: it runs as it is
        _said.append(True)
        log.warning("%s=avx2 on a CPU without %s: run as the CPU is", ISA_ENV, ", ".join(lacks))
    return [MARCH[isa], *FLAGS]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "kernels"


def compiler() -> str | None:
    """The C compiler: $CC, else cc, else gcc (None: none on PATH)."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def library_path(cc: str, flags: list[str], version: str) -> Path:
    """Where the library built by `cc` (of `version`) with `flags` is cached."""
    parts = [*(s.read_text() for s in SOURCES), " ".join(flags), version, target(cc, flags[0]),
             _cpu_flags(), platform.machine()]  # fmt: skip
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def build() -> Path | str:
    """The compiled library's path (compiled now if not cached), or why it cannot be."""
    cc = compiler()
    if cc is None:
        return "no C compiler (cc, gcc) on PATH"
    flags = compile_flags()
    tried = (cc, *flags, str(cache_dir()))
    if tried in _failed:
        return _failed[tried]
    why = _build(cc, flags)
    if isinstance(why, str):
        _failed[tried] = why
    return why


def _build(cc: str, flags: list[str]) -> Path | str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        out = library_path(cc, flags, version.stdout)
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        # compiled to a temporary name, then renamed: nodes starting together may race here
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            if done.returncode != 0:
                return f"{Path(cc).name} failed: {done.stderr.strip()[-300:]}"
            fd = os.open(tmp, os.O_RDONLY)
            try:  # on disk before its name says it is whole (a crash must not leave it empty)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:  # a read-only cache, a hung compiler
        return f"cannot build them: {e}"
    return out
