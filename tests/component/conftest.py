from __future__ import annotations

import pytest

from pdserve.common.config import EngineConfig
from tests.component.cluster import own_cache


@pytest.fixture(scope="session")
def torch_runners():
    """Three engines on the real SmolLM2 model: the same weights, separate KV caches."""
    from pdserve.common.engine.runner import ModelRunner

    ecfg = EngineConfig(num_kv_blocks=256, num_threads=1)
    first = ModelRunner(ecfg)
    return ecfg, first, own_cache(first), own_cache(first)
