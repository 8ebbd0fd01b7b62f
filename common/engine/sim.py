"""Simulated engine: the `Engine` interface with the forward pass replaced by the cost model.

It waits the modelled step time (x `sim_time_scale`), fires `on_layer` at evenly spaced
moments through a prefill as a real engine would (with no hook, one wait for the step), and
returns deterministic tokens: a pure function of (seed, position), so runs are reproducible
and a request's text does not depend on which node produced it. KV frames have the simulated
model's real size x `sim_kv_scale`, so transfers cost what they would. The "cache" does not
store them (dozens of sim nodes must fit in a small machine): import copies each frame into
one reused scratch buffer, which pays the copy a real cache would, and export hands out one
reused, pre-filled buffer.
Never imports torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from pdserve.common.config import EngineConfig
from pdserve.common.costmodel import CostModel
from pdserve.common.engine.interface import DecodeWork, LayerHook, PrefillWork
from pdserve.common.sampling import SamplingParams, counter_int

DEFAULT_KV_SCALE = EngineConfig.sim_kv_scale
FIRST_ORDINARY_TOKEN = 1000  # avoid special and control tokens of the embedded tokenizer
ORDINARY_TOKEN_SPAN = 20000


class SimEngine:
    def __init__(self, cfg: EngineConfig, sleep: bool = True) -> None:
        self.cfg = cfg
        self.cost = CostModel.named(cfg.sim_profile)
        m = self.cost.model
        self.model_id = f"sim-{cfg.sim_profile}"
        # the frames' size is part of the layout: nodes of other --sim-kv-scale values, whose
        # frames every transfer between them would refuse, are refused at registration (the
        # default scale keeps the layout older nodes state)
        scale = cfg.sim_kv_scale
        weights = m.layout().weights if scale == DEFAULT_KV_SCALE else f"sim{scale!r}"
        self.model_config = dataclasses.replace(m.layout(), weights=weights)
        self.eos_token_ids: tuple[int, ...] = ()
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len or m.max_context
        self.kernels = "sim"
        self.num_blocks = cfg.num_kv_blocks or self.cost.kv_capacity_tokens() // cfg.block_size
        if self.num_blocks < 1:  # the 70B profiles: one GPU's memory holds the weights alone
            raise ValueError(
                f"sim profile {cfg.sim_profile!r}: {m.weight_bytes / 1e9:.0f} GB of weights "
                f"leave no KV room in 90 % of one {self.cost.gpu.name}'s "
                f"{self.cost.gpu.hbm_bytes / 1e9:.0f} GB; give --num-kv-blocks"
            )
        per_layer = m.kv_bytes_per_token // m.num_layers
        self.sleep = sleep
        per_token = max(1, round(per_layer * cfg.sim_kv_scale))
        self.kv_store = SimKvStore(m.num_layers, self.num_blocks, self.block_size, per_token)
        self.modelled_seconds = 0.0  # total modelled (unscaled) time, for reports

    def step(
        self,
        prefills: Sequence[PrefillWork],
        decodes: Sequence[DecodeWork],
        on_layer: LayerHook | None = None,
    ) -> list[int]:
        modelled = self.cost.step_seconds(
            [(len(p.token_ids), p.start_pos) for p in prefills], [d.position + 1 for d in decodes]
        )
        self.modelled_seconds += modelled
        wall = modelled * self.cfg.sim_time_scale
        start = time.monotonic()
        # layer by layer only where a hook watches each layer land (a layer-wise KV push);
        # else one wait to the same end: a wake per layer cost CPU and changed nothing
        layers = self.model_config.num_layers if on_layer is not None else 1
        for i in range(layers):
            if self.sleep:
                delay = start + wall * (i + 1) / layers - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if on_layer is not None:
                on_layer(i)
        tokens = [self._token(p.params, p.end_pos) for p in prefills if p.params is not None]
        tokens += [self._token(d.params, d.position + 1) for d in decodes]
        return tokens

    @staticmethod
    def _token(params: SamplingParams, position: int) -> int:
        # greedy text depends on no seed, as a real engine's argmax does not
        seed = 0 if params.greedy else params.seed or 0
        return FIRST_ORDINARY_TOKEN + counter_int(seed, position, ORDINARY_TOKEN_SPAN)


class SimKvStore:
    """Simulated KV: frames of the modelled size (`--sim-kv-scale` of the real one) that
    travel like real ones; what lands is checked for size and kept in a scratch buffer."""

    staging = None  # plain bytes, no device

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, per_token: int) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.frame_bytes_per_token = per_token
        self._export = np.zeros(0, dtype=np.uint8)
        self._scratch = np.zeros(0, dtype=np.uint8)

    def _check(self, block_table: Sequence[int], num_tokens: int) -> None:
        """What the real cache's indexing refuses (a short table, a block it does not have),
        refused here too: a node's wrong table must not pass on the simulated engine."""
        if len(block_table) * self.block_size < num_tokens:
            raise IndexError(f"{num_tokens} tokens in a table of {len(block_table)} blocks")
        if any(not 0 <= b < self.num_blocks for b in block_table):
            raise IndexError(f"a block outside 0..{self.num_blocks - 1} in {list(block_table)}")

    def read_block(self, block: int) -> bytes:
        """A block's worth of (simulated) KV: every layer's frame bytes for block_size tokens."""
        self._check([block], 0)
        return bytes(self.frame_bytes(self.block_size) * self.num_layers)

    def write_block(self, block: int, data: bytes) -> None:
        self._check([block], 0)
        if len(data) != self.frame_bytes(self.block_size) * self.num_layers:
            raise ValueError(f"a block of {len(data)} bytes, not {len(self.read_block(block))}")

    def frame_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.frame_bytes_per_token

    def export_kv(self, layer: int, block_table: Sequence[int], num_tokens: int) -> memoryview:
        self._check(block_table, num_tokens)
        size = self.frame_bytes(num_tokens)
        if self._export.size < size + 1:  # odd layers start one byte in: room for that byte
            self._export = (np.arange(size * 2 + 1, dtype=np.uint64) % 251).astype(np.uint8)
        return memoryview(self._export[layer % 2 : layer % 2 + size].data)

    def export_frame(self, layer: int, block_table: Sequence[int], num_tokens: int) -> memoryview:
        return self.export_kv(layer, block_table, num_tokens)

    def export_parts(
        self, layer: int, block_table: Sequence[int], num_tokens: int
    ) -> list[memoryview]:
        return [self.export_kv(layer, block_table, num_tokens)]

    def kv_targets(
        self, layer: int, block_table: Sequence[int], num_tokens: int
    ) -> list[memoryview] | None:
        return None  # frames land in a scratch buffer (import_kv)

    def export_into(
        self, layer: int, block_table: Sequence[int], num_tokens: int, buf: memoryview
    ) -> None:
        size = self.frame_bytes(num_tokens)
        np.frombuffer(buf, dtype=np.uint8, count=size)[:] = np.frombuffer(
            self.export_kv(layer, block_table, num_tokens), dtype=np.uint8
        )

    def import_kv(
        self, layer: int, block_table: Sequence[int], num_tokens: int, frame: object
    ) -> None:
        if isinstance(frame, (list, tuple)):
            frame = b"".join(bytes(p) for p in frame)
        self._check(block_table, num_tokens)
        data = np.frombuffer(frame, dtype=np.uint8)  # type: ignore[call-overload]
        if data.size != self.frame_bytes(num_tokens):
            raise ValueError(
                f"KV frame of {data.size} bytes, expected {self.frame_bytes(num_tokens)}"
            )
        if self._scratch.size < data.size:
            self._scratch = np.empty(data.size * 2, dtype=np.uint8)
        self._scratch[: data.size] = data
