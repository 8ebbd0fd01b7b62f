"""gguf_matmul.c compiled for each target it has a path for, run as a plain program
(tests/unit/gguf_check.c): this CPU's build (AVX2 + FMA on x86-64, NEON on arm64, else the
portable loop) and arm64's NEON path (elsewhere cross-compiled and run under qemu-aarch64),
so the NEON code is held to the same checks on every CPU the suite runs on.

Checked per block kind (F32, a dense float32 matrix, among them), on odd shapes and row
counts around the 4-, 2- and 1-row tiles:
- the SIMD paths give the bits of a scalar emulation of their sums (16 lanes, `fmaf` in
  block order, the fixed fold): the lane layout, the fused multiply-adds and the fold are
  what the docs say, so AVX2 and NEON give the same bits (the portable loop, without fused
  multiply-adds, is held to the error bound only);
- every output within the float32 summation bound of the float64 product of the widened
  weights, and the widened weights equal gguf's dequantization bit for bit;
- a row's bits do not depend on the rows beside it (the token-for-token invariant).
"""

from __future__ import annotations

import os
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pdserve.common.cbuild import FLAGS, SOURCES, compile_flags, compiler
from pdserve.common.engine.gguf_linear import KINDS, gguf_ops
from pdserve.common.engine.loader import dequantize_blocks
from tests.unit.test_gguf_matmul import random_blocks

pytestmark = pytest.mark.cpu  # make test-cpu-variants: native and AVX2-only

CHECK = Path(__file__).with_name("gguf_check.c")
GGUF = next(s for s in SOURCES if s.name == "gguf_matmul.c")
SHAPES = [(1, 32, 1), (37, 96, 3), (577, 576, 9), (64, 1536, 6)]  # (N, K, rows)
# the program is built like the library (cbuild.FLAGS), as an executable
EXE_FLAGS = [f for f in FLAGS if f not in ("-fPIC", "-shared")]
ARM64_CC = "aarch64-linux-gnu-gcc"  # Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross
QEMU = "qemu-aarch64"  # Debian: qemu-user


def _on_arm64() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def _native_path(cc: str) -> str:
    """The path gguf_matmul.c compiles to here, from the compiler's own macros."""
    if _on_arm64():
        return "neon"
    march = compile_flags()[0]  # -march=native, or x86-64-v3 under PDSERVE_CPU_ISA=avx2
    probe = subprocess.run(
        [cc, march, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True
    )
    return "avx2" if "__AVX2__" in probe.stdout and "__FMA__" in probe.stdout else "portable"


def _build(cc: str, march: list[str], out: Path, static: bool = False) -> Path:
    cmd = [cc, *march, *EXE_FLAGS, *(["-static"] if static else []), "-o", str(out)]
    done = subprocess.run([*cmd, str(CHECK), str(GGUF), "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> tuple[list[str], str]:
    cc = compiler()
    if cc is None:  # the suite's machines have gcc: a real failure there
        pytest.fail("no C compiler (cc, gcc) on PATH")
    exe = _build(cc, compile_flags()[:1], tmp_path_factory.mktemp("native") / "check")
    return [str(exe)], _native_path(cc)


@pytest.fixture(scope="module")
def arm64(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("arm64") / "check"
    if _on_arm64():  # this CPU is one: its own compiler, run as it is
        cc = compiler()
        assert cc is not None, "no C compiler (cc, gcc) on PATH"
        return [str(_build(cc, ["-march=armv8-a"], out))]
    missing = [tool for tool in (ARM64_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        why = f"{', '.join(missing)} not on PATH (Debian: gcc-aarch64-linux-gnu qemu-user)"
        if os.environ.get("CI", "").lower() == "true":  # .ci/run installs them
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    # armv8-a: the base every arm64 CPU has (NEON included); static, so qemu needs no sysroot
    return [QEMU, str(_build(ARM64_CC, ["-march=armv8-a"], out, static=True))]


def _run(cmd: list[str], kind: str, n: int, k: int, rows: int) -> dict:
    blocks = random_blocks(kind, n, k)
    x = np.random.default_rng(n + k + rows).standard_normal((rows, k)).astype(np.float32)
    head = struct.pack("<iqqq", KINDS[kind], n, k, rows)
    done = subprocess.run(
        cmd,
        input=head + blocks.tobytes() + x.tobytes(),
        capture_output=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "2"},  # the row split across threads runs too
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = np.frombuffer(done.stdout[8:], np.float32)
    m = rows * n
    return {
        "path": done.stdout[:8].decode().strip(),
        "batch": out[:m].reshape(rows, n),
        "alone": out[m : 2 * m].reshape(rows, n),
        "emulated": out[2 * m : 3 * m].reshape(rows, n),
        "weights": out[3 * m :].reshape(n, k),
        "blocks": blocks,
        "x": x,
    }


def _dequantized(blocks: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    if kind == "F32":  # the floats themselves
        return blocks.reshape(n, k * 4).view(np.float32)
    return dequantize_blocks(blocks.reshape(-1), kind).reshape(n, k).numpy()


def _check(got: dict, kind: str, want_path: str) -> None:
    assert got["path"] == want_path
    n, k = got["weights"].shape
    theirs = _dequantized(got["blocks"], kind, n, k)
    assert np.array_equal(got["weights"].view(np.uint32), theirs.view(np.uint32))
    assert np.array_equal(got["batch"].view(np.uint32), got["alone"].view(np.uint32))
    if want_path != "portable":  # fused multiply-adds in the documented lanes and fold
        assert np.array_equal(got["batch"].view(np.uint32), got["emulated"].view(np.uint32))
    w, x = got["weights"].astype(np.float64), got["x"].astype(np.float64)
    exact = x @ w.T
    # float32 sums of k products, in any order: |error| <= k * 2^-24 * sum |w x| (Higham's
    # bound, first order; the products are exact enough that this is the whole error)
    bound = k * 2.0**-24 * (np.abs(x) @ np.abs(w).T) + 1e-30
    err = np.abs(got["batch"].astype(np.float64) - exact)
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("kind", KINDS)
def test_this_cpus_build_of_the_kernel(native, kind):
    cmd, path = native
    for n, k, rows in SHAPES:
        _check(_run(cmd, kind, n, k, rows), kind, path)


@pytest.mark.parametrize("kind", KINDS)
def test_the_arm64_neon_build_under_qemu(arm64, kind):
    for n, k, rows in SHAPES:
        _check(_run(arm64, kind, n, k, rows), kind, "neon")


def test_the_nodes_library_runs_the_path_this_cpus_build_has(native):
    """The library the engine loads (cbuild.build) says which path it runs, and it is the
    one checked above."""
    got = gguf_ops()
    assert not isinstance(got, str), got
    assert got[0].path == native[1]


def test_the_whole_kernel_library_builds_for_arm64(arm64, tmp_path):
    """What a node on arm64 compiles at start (cbuild.build: both sources, one library)."""
    out = tmp_path / "kernels.so"
    cc = compiler() if _on_arm64() else ARM64_CC
    assert cc is not None
    done = subprocess.run(
        [cc, "-march=armv8-a", *FLAGS, "-Werror", "-o", str(out), *map(str, SOURCES)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 0
