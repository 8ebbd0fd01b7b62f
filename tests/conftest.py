"""Shared fixtures. The real SmolLM2 model is loaded once per session (a few seconds) and
shared; each test builds its own scheduler/engine around it."""

from __future__ import annotations

import os

import pytest

import pdserve  # noqa: F401  (PDSERVE_CPU_ISA=avx2 limits torch here, before any test uses it)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]


# `make test` runs two pytest-xdist workers (`-n 2`): a test file is one unit of work, so
# its module fixtures (a cluster, a stack) start once, on one worker; both Docker files are
# one unit (one image build and wheels folder per session), started first as the longest.
DOCKER_FILES = ("tests/e2e/test_compose.py", "tests/e2e/test_compose_ha.py")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER.startswith("gw") and WORKER[2:].isdigit():
    # each worker's free_port draws from its own slice of the ports below the kernel's
    # ephemeral range: two workers never hand one port to two clusters starting at once
    from pdserve.common.wire.transport import _port_range

    _low, _high = _port_range()
    _slice = (_high - _low) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    _start = _low + int(WORKER[2:]) * _slice
    os.environ["PDSERVE_PORT_RANGE"] = f"{_start}-{_start + _slice}"
    # The other worker holds a core most of the time: a worker's own torch team (2 threads)
    # then has one thread descheduled, and libgomp's default spin at every barrier stalls
    # it (measured, GGUF parity with one core busy: 31.5 s spinning, 13.3 s passive; alone
    # 9.0 against 9.8 s). libgomp reads the policy once, when torch loads it: set for this
    # process only, then removed, so the nodes a test starts keep pdserve's own rule
    # (launch.py node_spawn_options), which is what the tests check.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "passive"
        import torch  # noqa: F401

        del os.environ["OMP_WAIT_POLICY"]


def unit_of_work(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return "docker" if path in DOCKER_FILES else path


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    # xdist's own `--dist loadgroup` marks do not reach its scheduler under pytest 9.2
    # (pytest-xdist#1386), so the grouping is this scheduler's
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return ByFile(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if WORKER:  # the Docker unit first: the scheduler hands units out in collection order
        items.sort(key=lambda item: unit_of_work(item.nodeid) != "docker")  # stable


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        help="the chaos suite's long form (tests/chaos/): 10x the fuzz cases, longer loads",
    )


# What the chaos suite and the compose test print (their figures), kept from the captured
# output of passing tests and shown in one section at the end of the run: a CI log has them
# without -s.
FIGURES: list[tuple[str, str]] = []
FIGURE_TESTS = ("tests/chaos/", "tests/e2e/test_compose.py")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed and report.nodeid.startswith(FIGURE_TESTS):
        for line in report.capstdout.splitlines():
            if line.strip():
                FIGURES.append((report.nodeid, line.strip()))


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if FIGURES:
        terminalreporter.section("chaos figures")
        for nodeid, line in FIGURES:
            terminalreporter.write_line(f"{nodeid.split('::')[-1]}: {line}")


@pytest.fixture(scope="session")
def chaos_scale(request: pytest.FixtureRequest) -> int:
    """How much longer the chaos suite runs: 1 in `make test`, 10 with --chaos-long."""
    return 10 if request.config.getoption("--chaos-long") else 1


@pytest.fixture(scope="session")
def tokenizer():
    from pdserve.common.model.tokenizer import Tokenizer

    return Tokenizer.load(None)


@pytest.fixture(scope="session")
def smol_runner():
    import torch

    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.runner import ModelRunner

    torch.set_num_threads(2)
    return ModelRunner(EngineConfig(num_kv_blocks=512))


def make_engine(runner, tokenizer, **overrides):
    """A fresh colocated engine (own scheduler and block manager) around a shared runner."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    cfg = EngineConfig(num_kv_blocks=runner.num_blocks, **overrides)
    return LLMEngine(cfg, engine=runner, tokenizer=tokenizer)


def gateway_request(rid: str, n: int = 32, tokenizer=None):
    """A gateway request of an n-token prompt (no tokenizer needed unless tokens arrive)."""
    from pdserve.common.sampling import SamplingParams
    from pdserve.gateway.requests import GatewayRequest

    return GatewayRequest(
        request_id=rid,
        kind="completion",
        model="m",
        prompt_ids=list(range(n)),
        params=SamplingParams(),
        stream=False,
        include_usage=False,
        tokenizer=tokenizer,
    )


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )
