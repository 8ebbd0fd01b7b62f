"""What a node needs from an engine, whether torch or simulated. Pure Python.

One `step` runs a batch of prefill chunks and decode tokens and returns the sampled tokens;
`on_layer(i)` fires as soon as layer i's KV is in the cache so a prefill node can start
sending that layer while later layers compute. `kv_store` is the engine's KV cache: the
connectors move one request's KV per layer through it, in the block-independent frame
format of `kv_cache.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.common.model.config import ModelConfig
from pdserve.common.sampling import SamplingParams

LayerHook = Callable[[int], None]


@dataclass
class PrefillWork:
    seq_id: str
    token_ids: list[int]  # the tokens of this chunk
    start_pos: int  # sequence position of token_ids[0]; > 0 for later chunks
    block_table: list[int]
    params: SamplingParams | None  # None: not the last chunk, nothing to sample

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class DecodeWork:
    seq_id: str
    token_id: int  # the newest token, whose KV this step computes
    position: int
    block_table: list[int]
    params: SamplingParams


class Engine(Protocol):
    model_config: ModelConfig
    block_size: int
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kernels: str  # which code runs the model, for /metrics: "fused+gguf", "eager", "sim", ...

    def step(
        self,
        prefills: Sequence[PrefillWork],
        decodes: Sequence[DecodeWork],
        on_layer: LayerHook | None = None,
    ) -> list[int]:
        """Tokens sampled: one per prefill with params (in order), then one per decode."""
        ...

    @property
    def kv_store(self) -> KvStore:
        """The engine's KV cache as connectors and prefix tiers see it (registered with them
        once, by the node runtime)."""
        ...


class KvStore(Protocol):
    """One node's paged KV cache, the one way KV bytes enter or leave it: frames of one
    request's layer for the connectors (as parts, into a buffer, or read straight into
    writable views), whole blocks for the prefix cache's lower tiers."""

    num_layers: int
    num_blocks: int
    block_size: int
    staging: Any  # the host copies of a device cache (staging.Staging); None for plain bytes

    def frame_bytes(self, num_tokens: int) -> int:
        """Size of one layer's frame for a request of num_tokens tokens."""
        ...

    def export_kv(self, layer: int, block_table: Sequence[int], num_tokens: int) -> Any:
        """One layer's frame (buffer protocol) for the first num_tokens tokens."""
        ...

    def export_frame(self, layer: int, block_table: Sequence[int], num_tokens: int) -> memoryview:
        """The same frame as raw bytes, ready for a zero-copy send."""
        ...

    def export_parts(self, layer: int, block_table: Sequence[int], num_tokens: int) -> list[Any]:
        """The frame as parts whose concatenation is the frame, viewing the cache where it
        can (a zero-copy multipart send), or staged copies on their way to host memory
        (`staging.Staged`, from a GPU cache: the sender waits for them); import_kv takes a
        list of buffers as well."""
        ...

    def kv_targets(
        self, layer: int, block_table: Sequence[int], num_tokens: int
    ) -> list[memoryview] | None:
        """Writable views of the cache where the frame's bytes go, in frame order, for a
        socket to read into; None when the cache cannot be written in place (GPU, sim)."""
        ...

    def export_into(
        self, layer: int, block_table: Sequence[int], num_tokens: int, buf: memoryview
    ) -> None:
        """Write the frame straight into `buf` (shared memory, a reused staging buffer)."""
        ...

    def import_kv(
        self, layer: int, block_table: Sequence[int], num_tokens: int, frame: Any
    ) -> None: ...

    def read_block(self, block: int) -> bytes:
        """Every layer's KV of one block as host bytes (the prefix cache's lower tiers)."""
        ...

    def write_block(self, block: int, data: bytes) -> None:
        """Put bytes from read_block back into a block (of this or an equal engine)."""
        ...


def sample_positions(prefills: Sequence[PrefillWork], decodes: Sequence[DecodeWork]) -> list[int]:
    """Sequence position of each token to be sampled (the key of its random draw)."""
    return [p.end_pos for p in prefills if p.params is not None] + [d.position + 1 for d in decodes]
