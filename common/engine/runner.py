"""The torch engine: model + paged KV cache + sampler behind the `Engine` interface."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine import shared_kv
from pdserve.common.engine.interface import DecodeWork, LayerHook, PrefillWork, sample_positions
from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.engine.loader import Widen, iter_weights
from pdserve.common.engine.model import AttentionMetadata, LlamaModel, PrefillSpan
from pdserve.common.engine.sampler import sample
from pdserve.common.errors import ConfigError
from pdserve.common.model.config import (
    ModelConfig,
    ModelSource,
    load_model_config,
    resolve_model,
)
from pdserve.common.numerics import code_path, isa_level

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def num_kv_blocks(cfg: EngineConfig, model_cfg: ModelConfig, element_size: int) -> int:
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    per_block = cfg.block_size * model_cfg.kv_bytes_per_token(element_size)
    return max(1, int(cfg.kv_cache_gb * 2**30) // per_block)


def build_model(
    cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    """The model's parameters made in their own dtype on the device: made in float32 and
    converted after loading, a bfloat16 model needed twice its size on the GPU to load (an
    8B one 32 GB). The RoPE tables are float32 whatever the default (made so explicitly)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # process-wide: the load runs before any other work
    try:
        with torch.device(device):
            return LlamaModel(cfg, max_len)
    finally:
        torch.set_default_dtype(old)


def _widen(cfg: EngineConfig) -> Widen | None:
    """The C kernels' dequantizer for a GGUF's blocks at load, where they build and are not
    turned off (--cpu-kernels); else None: torch's ops, the same bits."""
    if cfg.cpu_kernels == "off":
        return None
    from pdserve.common.engine.gguf_linear import gguf_ops

    got = gguf_ops()
    return None if isinstance(got, str) else got[0].widen


class ModelRunner:
    gguf_path = ""  # gguf_matmul.c's SIMD path where its kernels run the projections

    def __init__(self, cfg: EngineConfig, eos_token_ids: tuple[int, ...] | None = None) -> None:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        source = resolve_model(cfg.model)
        self.model_config = load_model_config(source)
        self.model_id = source.model_id
        self.eos_token_ids = eos_token_ids or self.model_config.eos_token_ids
        self.dtype = DTYPES[cfg.dtype]
        self.device = torch.device(cfg.device)
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.model = build_model(self.model_config, self.max_model_len, self.device, self.dtype)
        widen = _widen(cfg) if source.kind == "gguf" else None
        self.model.load_weights(iter_weights(source, self.model_config, widen), self.dtype)
        self.kernels = "eager"  # what runs the model (engine_info on /metrics): set below
        self._quantize(cfg, source)
        self._row_invariant(cfg)
        self._use_kernels(cfg)
        self.model.eval()
        self.num_blocks = num_kv_blocks(cfg, self.model_config, self.dtype.itemsize)
        mc = self.model_config
        self.kv_cache = KVCache(
            mc.num_layers,
            self.num_blocks,
            cfg.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            shared=self._share_cache(cfg, self.num_blocks * cfg.block_size),
        )
        log.info(
            "torch engine: %s %s on %s, %d KV blocks of %d tokens",
            self.model_id,
            cfg.dtype,
            cfg.device,
            self.num_blocks,
            cfg.block_size,
        )

    def _quantize(self, cfg: EngineConfig, source: ModelSource) -> None:
        """--quantization (auto is resolved in common/config.py): int4 keeps a GGUF's 4-bit
        blocks for the projections and its Q8_0 LM head exactly (two 4-bit planes); int8
        quantizes every projection per output channel at load, the LM head stays float
        (quant.py)."""
        mode = cfg.quantization
        if mode == "none":
            log.info("weights dequantized to %s (--quantization none)", cfg.dtype)
            return
        if self.device.type != "cpu":
            raise ConfigError(
                f"--quantization {mode}: its kernels are CPU kernels, not {self.device.type}"
            )
        from pdserve.common.engine import quant

        if mode == "int8":
            n = quant.quantize_int8(self.model, self.dtype)
            log.info("--quantization int8: %d layers as int8 per output channel", n)
            return
        if source.kind != "gguf":
            raise ConfigError("--quantization int4: not a GGUF file (int8 quantizes any model)")
        if self.dtype == torch.float32 and self._gguf_blocks(cfg, source):
            return
        n = quant.quantize_gguf_linears(self.model, source.path, self.model_config, self.dtype)
        head = quant.quantize_gguf_lm_head(self.model, source.path, self.dtype)
        log.info(
            "--quantization int4: %d projections kept as 4-bit groups of 32%s", n,
            ", the LM head from its Q8_0 blocks" if head else "",
        )  # fmt: skip

    def _gguf_blocks(self, cfg: EngineConfig, source: ModelSource) -> bool:
        """float32 --quantization int4 on gguf_matmul.c's kernels (gguf_linear.py); False,
        logged, where they do not build: torch's 4-bit kernel then, ~9x slower than these."""
        from pdserve.common.engine.gguf_linear import gguf_ops, quantize_gguf

        got = gguf_ops() if cfg.cpu_kernels == "auto" else "--cpu-kernels off"
        if isinstance(got, str):
            log.warning("--quantization int4 in float32 on torch's 4-bit kernel (slow): %s", got)
            return False
        n, head = quantize_gguf(self.model, source.path, self.model_config, got[0])
        self.kernels, self.gguf_path = "gguf", got[0].path
        log.info(
            "--quantization int4: %d projections on their GGUF blocks for generated tokens "
            "(dense float32 for prompt tokens)%s; the %s kernel", n,
            ", the LM head on its blocks" if head else "", got[0].path,
        )  # fmt: skip
        return True

    def _row_invariant(self, cfg: EngineConfig) -> None:
        """float32 on CPU: the linear layers still on F.linear (all of them with
        --quantization none), whose rows MKL computes otherwise at few rows, on gguf_matmul.c's
        F32 kernel for generated tokens and row-padded F.linear for prompt tokens; on padded
        F.linear alone where the kernels are not built (gguf_linear.f32_linears, rows.py)."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            return
        from pdserve.common.engine.gguf_linear import f32_linears, gguf_ops
        from pdserve.common.engine.rows import warm

        got = gguf_ops() if cfg.cpu_kernels == "auto" else "--cpu-kernels off"
        kernel, padded = f32_linears(self.model, None if isinstance(got, str) else got[0])
        if kernel and self.kernels == "eager":
            self.kernels = "f32"
        if kernel and not self.gguf_path:  # the F32 kernel's SIMD path decides its bits
            self.gguf_path = got[0].path if not isinstance(got, str) else ""
        if kernel or padded:
            log.info(
                "float32: %d linear layers on the F32 kernel for generated tokens (prompt "
                "tokens on row-padded F.linear), %d on row-padded F.linear for every token",
                kernel, padded,
            )  # fmt: skip
        warm(self.model)

    def _use_kernels(self, cfg: EngineConfig) -> None:
        """--cpu-kernels auto: bf16 weights packed for oneDNN (packed.py), and the fused C
        kernels where they build (kernels.py), else eager ops; off: neither."""
        if cfg.cpu_kernels == "off":
            return
        from pdserve.common.engine.kernels import load
        from pdserve.common.engine.quant import prepack

        if packed := prepack(self.model):
            log.info("%d linear layers' bf16 weights packed in oneDNN's layout", packed)

        mc = self.model_config
        got = load(self.dtype, self.device, mc.head_dim, mc.num_heads // mc.num_kv_heads)
        if isinstance(got, str):  # on CPU a WARNING: a node this slow should say why
            warn = log.warning if self.device.type == "cpu" else log.info
            warn("eager torch ops for norms, RoPE and attention: %s", got)
            return
        self.model.use_kernels(got)
        self.kernels = "fused" if self.kernels == "eager" else f"fused+{self.kernels}"
        log.info("fused CPU kernels for norms, RoPE + KV write, decode attention and SiLU")

    @functools.cached_property
    def code_path(self) -> str:
        """What computes this engine's numbers beyond --dtype and --quantization, as it runs:
        the fused C kernels or eager ops, gguf_matmul.c's SIMD path or torch's linear ops, the
        CPU level (numerics.code_path). Nodes that differ in it differ in the last bits, so
        a gateway refuses one whose path differs from its cluster's. "" off CPU (unchecked)."""
        if self.device.type != "cpu":
            return ""
        kernels = "fused" if self.model.kernels is not None else "eager"
        linear = f"gguf-{self.gguf_path}" if self.gguf_path else "torch"
        return code_path(kernels=kernels, linear=linear, isa=isa_level(self.cfg.dtype))

    def _share_cache(self, cfg: EngineConfig, tokens: int) -> bool:
        """Whether the KV cache goes to /dev/shm (--kv-shared-cache; shared_kv.py)."""
        if cfg.kv_shared_cache == "off":
            return False
        if self.device.type != "cpu":
            if cfg.kv_shared_cache == "on":  # the GPU path shares through CUDA IPC instead
                raise ConfigError("--kv-shared-cache on needs a CPU engine (--device cpu)")
            return False
        size = tokens * self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        if shared_kv.fits(size):
            return True
        if cfg.kv_shared_cache == "on" and not shared_kv.fits(size, margin=0):
            raise ConfigError(f"--kv-shared-cache on: /dev/shm has no room for {size} bytes")
        if cfg.kv_shared_cache == "auto":
            log.info("KV cache stays private: /dev/shm lacks room for it (--kv-shared-cache)")
        return cfg.kv_shared_cache == "on"

    # -- slots ---------------------------------------------------------------------------
    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        return self.kv_cache.slots(block_table, start, end)

    def _metadata(
        self, prefills: Sequence[PrefillWork], decodes: Sequence[DecodeWork]
    ) -> AttentionMetadata:
        slot_parts, spans, q_start = [], [], 0
        for p in prefills:
            n = len(p.token_ids)
            slot_parts.append(self.slots(p.block_table, p.start_pos, p.end_pos))
            ctx_slots = None if p.start_pos == 0 else self.slots(p.block_table, 0, p.end_pos)
            spans.append(PrefillSpan(q_start, n, p.end_pos, ctx_slots))
            q_start += n
        decode_blocks = decode_bias = decode_lens = None
        if decodes:
            decode_blocks, decode_bias, decode_lens, newest = self._decode_slots(decodes)
            slot_parts.append(newest)
        return AttentionMetadata(
            torch.cat(slot_parts), spans, q_start, decode_blocks, decode_bias, decode_lens
        )

    def _decode_slots(
        self, decodes: Sequence[DecodeWork]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Every decoding sequence's block table (B, nb), padded with block 0, the attention
        bias of its slots (B, 1, 1, nb * block_size: 0 where real, -inf for padding; None
        with the fused kernels, which need none), its context length (B,) and the newest
        token's slot (B,): built for the whole batch at once from one padded tensor (one
        host-to-device copy, not tensors per sequence: on CUDA each would be its own copy
        and launch)."""
        bs = self.block_size
        lengths_list = [d.position + 1 for d in decodes]
        nblocks = -(-max(lengths_list) // bs)
        tables = [d.block_table[:nblocks] + [0] * (nblocks - len(d.block_table[:nblocks]))
                  for d in decodes]  # fmt: skip
        table = torch.tensor(tables, dtype=torch.long).to(self.device, non_blocking=True)
        lengths = torch.tensor(lengths_list, dtype=torch.long).to(self.device, non_blocking=True)
        last = lengths - 1
        newest = table.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs  # (B,)
        if self.model.kernels is not None:  # the fused attention reads `lengths` instead
            return table, None, lengths, newest
        pos = torch.arange(nblocks * bs, device=self.device)  # (L,)
        valid = pos.unsqueeze(0) < lengths.unsqueeze(1)  # (B, L)
        bias = torch.zeros(valid.shape, device=self.device).masked_fill_(~valid, float("-inf"))
        return table, bias[:, None, None, :], lengths, newest

    # -- Engine interface ----------------------------------------------------------------
    def step(
        self,
        prefills: Sequence[PrefillWork],
        decodes: Sequence[DecodeWork],
        on_layer: LayerHook | None = None,
    ) -> list[int]:
        if not prefills and not decodes:
            return []
        logits = self.forward(prefills, decodes, on_layer, all_rows=False)
        if logits.shape[0] == 0:
            return []
        params = [p.params for p in prefills if p.params is not None] + [d.params for d in decodes]
        return sample(logits, params, sample_positions(prefills, decodes))

    def forward(
        self,
        prefills: Sequence[PrefillWork],
        decodes: Sequence[DecodeWork],
        on_layer: LayerHook | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Float32 logits of the rows that sample (or of every token, with all_rows)."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        rows: list[int] = []
        for p in prefills:
            ids.extend(p.token_ids)
            pos.append(torch.arange(p.start_pos, p.end_pos))
            if p.params is not None:
                rows.append(len(ids) - 1)
        for d in decodes:
            ids.append(d.token_id)
            pos.append(torch.tensor([d.position]))
            rows.append(len(ids) - 1)
        meta = self._metadata(prefills, decodes)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat(pos).to(self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_cache, on_layer)
        return self.model.logits(hidden if all_rows else hidden[rows]).cpu()

    @property
    def kv_store(self) -> KVCache:
        """The paged cache is the engine's KV store (common/engine/interface.py)."""
        return self.kv_cache
