"""Shared fixtures. The real SmolLM2 model is loaded once per session (a few seconds) and
shared; each test builds its own scheduler/engine around it."""

from __future__ import annotations

import os

import pytest

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        help="the chaos suite's long form (tests/chaos/): 10x the fuzz cases, longer loads",
    )


@pytest.fixture(scope="session")
def chaos_scale(request: pytest.FixtureRequest) -> int:
    """How much longer the chaos suite runs: 1 in `make test`, 10 with --chaos-long."""
    return 10 if request.config.getoption("--chaos-long") else 1


@pytest.fixture(scope="session")
def tokenizer():
    from pdserve.common.tokenizer import Tokenizer

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
