"""What `pip install .` puts on a machine: one top-level import name, real files, no links."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_only_pdserve_with_every_layer_inside(tmp_path):
    src, target = tmp_path / "src", tmp_path / "site"  # built from a copy: no build/ left here
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "tests")
    shutil.copytree(ROOT, src, symlinks=True, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["bin", "pdserve"]  # bin/: the console script
    pkg = target / "pdserve"
    for layer in ("common", "gateway", "prefill_node", "decode_node", "colocated_node", "loadgen"):
        assert (pkg / layer / "__init__.py").is_file() and not (pkg / layer).is_symlink()
    assert (pkg / "common" / "engine" / "model.py").is_file()
    for source in ("cpu_kernels.c", "gguf_matmul.c"):  # built where they run (cbuild.py)
        assert (pkg / "common" / "engine" / source).is_file()
    assert not any(os.path.islink(os.path.join(d, f)) for d, _, fs in os.walk(pkg) for f in fs)
    code = "import pdserve.cli, pdserve.common.wire.protocol; print(pdserve.cli.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert out.stdout.startswith(str(pkg))
