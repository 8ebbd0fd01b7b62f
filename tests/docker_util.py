"""Finding a Docker CLI with the compose plugin (and, for the stack test, an engine).

With CI=true a missing piece fails the test: CI must run the compose tests for real
(`.ci/run` installs and starts the engine). Elsewhere, a laptop without Docker, they skip
and say what is missing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def _missing(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {why} (.ci/run prepares Docker; see .ci/docker.sh)")
    pytest.skip(f"{why}: install Docker with the compose plugin to run this test")


def compose_cli() -> list[str]:
    """`docker compose`, for commands that need no engine (`config`)."""
    if shutil.which("docker") is None:
        _missing("no docker CLI on PATH")
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
    if done.returncode != 0:
        _missing("the docker compose plugin is not installed")
    return ["docker", "compose"]


def compose_or_skip() -> list[str]:
    """`docker compose` with a running engine."""
    cmd = compose_cli()
    done = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    if done.returncode != 0:
        _missing("no Docker engine is running")
    return cmd


# once per test session: both stacks use one image of one source tree, so the second stack's
# wheels check and cached build (~15 s on 2 vCPUs) would only repeat the first's
_built: list[bool] = []


# the tests' wheels: in docker/wheels they made a later `docker compose build` (a GPU image,
# another Python) install offline from them, and fail
TEST_WHEELS = "docker/wheels-test"


def build_once(run: Callable[..., subprocess.CompletedProcess]) -> None:
    """`compose build` of the test image, the first time a stack asks in this session."""
    if not _built:
        run("build", "gateway")
        _built.append(True)


@functools.cache
def _wheels(root: Path) -> None:
    subprocess.run(["bash", str(root / "docker/wheels.sh")], check=True, cwd=root, timeout=900,
                   env={**os.environ, "PYTHON": sys.executable, "DEST": TEST_WHEELS})  # fmt: skip


def stack_env(root: Path, port: int, models: Path) -> dict[str, str]:
    """The wheels downloaded on the host (docker/wheels.sh: the image installs offline; once
    per session) and the environment of a test stack: the test image on the local base
    image, the API on 127.0.0.1:`port`, the embedded model (`models` is empty), small KV and
    shared memory."""
    _wheels(root)
    return {
        **os.environ,
        "PDSERVE_IMAGE": "pdserve:test",
        "PDSERVE_WHEELS": TEST_WHEELS,
        "PDSERVE_BASE_IMAGE": os.environ.get(
            "PDSERVE_TEST_BASE_IMAGE", "python:3.11-slim-bookworm"
        ),
        "PDSERVE_BIND": "127.0.0.1",
        "PDSERVE_PORT": str(port),
        "PDSERVE_MODEL_DIR": str(models),
        "PDSERVE_KV_CACHE_GB": "0.25",
        "PDSERVE_SHM_SIZE": "512mb",
        "PDSERVE_HEARTBEAT_TIMEOUT": "1",  # the chaos tests' detection bound
        # the numerics of the tests' own reference engine (float32, as compose.cpu.yaml):
        # `auto` timed again in an image built beside other work may choose otherwise
        "PDSERVE_QUANTIZATION": _host_quantization(),
    }


def _host_quantization() -> str:
    from pdserve.common.config import EngineConfig

    return EngineConfig(dtype="float32").quantization
