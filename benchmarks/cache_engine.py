"""A bare paged KV cache with the frame half of the Engine interface (no model), so the
transfer benchmarks move real KV between real paged caches of any model's layout."""

from __future__ import annotations

import torch

from common.costmodel import MODELS
from common.engine.kv_cache import KVCache
from common.model_config import ModelConfig

_L = MODELS["llama3.1-8b"]
LLAMA_LAYOUT = ModelConfig(
    vocab_size=_L.vocab_size,
    hidden_size=_L.hidden_size,
    intermediate_size=0,
    num_layers=_L.num_layers,
    num_heads=_L.num_heads,
    num_kv_heads=_L.num_kv_heads,
    head_dim=_L.head_dim,
    rms_norm_eps=1e-5,
    rope_theta=5e5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)


class CacheOnlyEngine:
    def __init__(
        self, layout: ModelConfig, num_tokens: int, block_size: int, dtype: torch.dtype
    ) -> None:
        blocks = -(-num_tokens // block_size) + 1
        self.model_config = layout
        self.block_size = block_size
        self.cache = KVCache(
            layout.num_layers, blocks, block_size, layout.num_kv_heads, layout.head_dim, dtype
        )
        self.kv_frame_bytes = self.cache.frame_bytes
        self.export_frame = self.cache.export_frame
        self.export_into = self.cache.export_into
        self.import_kv = self.cache.import_kv
