"""A bare paged KV cache behind the Engine's `kv_store` (no model), so the
transfer benchmarks move real KV between real paged caches of any model's layout."""

from __future__ import annotations

import torch

from pdserve.common.costmodel import MODELS
from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.model.config import ModelConfig

LLAMA_LAYOUT = MODELS["llama3.1-8b"].layout()


class CacheOnlyEngine:
    def __init__(
        self,
        layout: ModelConfig,
        num_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        shared: bool = False,
        device: str = "cpu",
    ) -> None:
        blocks = -(-num_tokens // block_size) + 1
        self.model_config = layout
        self.block_size = block_size
        self.max_model_len = num_tokens
        self.cache = KVCache(
            layout.num_layers,
            blocks,
            block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype,
            device,
            shared=shared,  # in /dev/shm: a peer can write into it (shm_direct)
        )
        self.kv_cache = self.kv_store = self.cache
