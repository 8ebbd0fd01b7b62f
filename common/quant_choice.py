"""`--quantization auto` in float32: whether gguf_matmul.c's kernel beats a dense float32
matmul on this CPU, measured once per kernel build and cached as JSON beside the library.

torch-free, as EngineConfig is resolved in processes that never load the engine (`pdserve up`'s
launcher); the measurement itself runs in a child process (`python -m
pdserve.common.engine.gguf_linear`, ~3 s once per machine), under a lock so that nodes
starting together measure once and on a quiet CPU.
"""

from __future__ import annotations

import fcntl
import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def kernel_pays(kernel_s: float, dense_s: float) -> bool:
    """The blocks for decode rows where one row through them beats one dense float32 row by a
    margin the measurement's noise cannot fake (10 %)."""
    return kernel_s < 0.9 * dense_s


def _measured() -> tuple[float, float] | str:
    cmd = [sys.executable, "-m", "pdserve.common.engine.gguf_linear"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the measurement did not run: {e}"
    try:
        kernel_s, dense_s = json.loads(done.stdout.strip().splitlines()[-1])
        return float(kernel_s), float(dense_s)
    except (ValueError, IndexError, TypeError):
        return f"the measurement failed: {done.stderr.strip()[-300:]}"


# the measurement's dense row (1536 x 576 float32, gguf_linear.measure) read slower than this
# means the CPU was not the measurement's (a CPU quota, a busy host): any core this runs on
# streams memory at several GB/s. The kernel reads a sixth of those bytes: slower than dense
# by more than KERNEL_SLACK, its threads were not running (seen in an image build beside
# other work: 2,496 us against 146, where a quiet run gives 80 against 203). Such a result
# decides this start, and is not kept
DENSE_ROW_BYTES = 1536 * 576 * 4
MIN_DENSE_GBPS = 1.0
KERNEL_SLACK = 4.0


def starved(kernel_s: float, dense_s: float) -> bool:
    slow_dense = dense_s > 0 and DENSE_ROW_BYTES / dense_s < MIN_DENSE_GBPS * 1e9
    return slow_dense or kernel_s > KERNEL_SLACK * dense_s


def _cached(path: Path) -> tuple[float, float] | str:
    try:
        kernel_s, dense_s = json.loads(path.read_text())
        if not starved(float(kernel_s), float(dense_s)):  # kept by an older version: again
            return float(kernel_s), float(dense_s)
    except (OSError, ValueError, TypeError):
        pass
    got = _measured()
    if isinstance(got, str):
        return got
    if starved(*got):
        log.warning("--quantization auto: the CPU was busy or throttled while measuring "
                    "(a row: 4-bit %.0f us, dense %.0f us): not cached", got[0] * 1e6,
                    got[1] * 1e6)  # fmt: skip
    else:
        path.write_text(json.dumps(list(got)))
    return got


def choice(key: str, cache: Path) -> tuple[bool, str]:
    """(whether auto picks the kernel, why) for the kernel build `key`, cached in `cache`."""
    path = cache / f"gguf-choice-{key}.json"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f"gguf-choice-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            got = _cached(path)
    except OSError as e:  # a read-only cache: measured again next start
        log.info("cannot cache the 4-bit kernel's timing: %s", e)
        got = _measured()
    if isinstance(got, str):
        return False, got
    kernel_s, dense_s = got
    why = (f"a 1536x576 row: 4-bit blocks {kernel_s * 1e6:.0f} us, "
           f"dense float32 {dense_s * 1e6:.0f} us")  # fmt: skip
    return kernel_pays(kernel_s, dense_s), why


def auto_quantization(model: str | None, engine: str, device: str, dtype: str, kernels: str) -> str:
    """`--quantization auto` resolved: int4 for a GGUF model on CPU, in bfloat16 always (torch's
    4-bit kernel), in float32 where gguf_matmul.c's kernel beats dense (`choice`); else none."""
    gguf = not model or str(model).endswith(".gguf")  # "" too: the embedded GGUF (compose)
    if not gguf or engine != "torch" or device != "cpu":
        return "none"
    if dtype == "bfloat16":
        return "int4"
    if dtype != "float32" or kernels == "off":
        return "none"
    from pdserve.common.cbuild import build

    built = build()
    if isinstance(built, str):
        log.warning("--quantization auto: none (%s)", built)
        return "none"
    pays, why = choice(built.stem, built.parent)
    log.info("--quantization auto: %s (%s)", "int4" if pays else "none", why)
    return "int4" if pays else "none"
