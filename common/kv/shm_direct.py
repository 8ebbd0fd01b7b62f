"""The shm_direct backend: one copy from the prefill node's paged cache into the decode
node's, on one host, CPU.

A decode node whose KV cache lives in /dev/shm (`--kv-shared-cache`, shared_kv.py) shares
the cache file's path; the prefill node maps it once and copies each layer from its own
blocks straight into the granted ones (direct.py): no frame, no segment, no socket. The shm
backend copies twice (cache -> segment -> cache), the socket ones twice plus the kernel's.
Chosen by `auto` ahead of shm whenever both ends are on one host (same identity, as shm)
with torch caches of one layout; the sim engine has no cache to share.
"""

from __future__ import annotations

import os

import torch

from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.engine.shared_kv import map_cache
from pdserve.common.kv.base import Backend
from pdserve.common.kv.direct import DirectReceive, DirectSend


class ShmDirectSend(DirectSend):
    name = "shm_direct"

    def can_write(self, own: KVCache, shared: str) -> bool:
        return own.data.device.type == "cpu"

    def attach(self, shared: str, layout: tuple[int, ...], dtype: str) -> torch.Tensor:
        return map_cache(shared, layout, getattr(torch, dtype))

    def gone(self, shared: str) -> bool:
        return not os.path.exists(shared)


class ShmDirectReceive(DirectReceive):
    def share(self, cache: KVCache) -> str | None:
        return cache.shared.path if cache.shared is not None else None


CONNECTOR = Backend("shm_direct", ShmDirectSend, ShmDirectReceive, auto_rank=-1)
