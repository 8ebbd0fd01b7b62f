"""Weights from a GGUF file (dequantized with `gguf`) or a Hugging Face safetensors folder.

Both paths yield tensors under Hugging Face's Llama names, so the model has one loading
routine. GGUF stores Q and K rows permuted for llama.cpp's interleaved RoPE; we undo that
permutation (as transformers' GGUF loader does) because the model uses the rotate-half form.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.config import ModelConfig, ModelSource, open_gguf

GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# (blocks, kind, shape) -> float32 tensor: GGUF blocks widened (Q4_0, Q4_1, Q8_0)
Widen = Callable[[np.ndarray, str, tuple[int, ...]], torch.Tensor]


def iter_weights(
    source: ModelSource, cfg: ModelConfig, widen: Widen | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float tensor) for every weight of the model. `widen`: how GGUF
    blocks become floats (the C kernels' dequantizer, gguf_linear.GgufOps.widen: ~0.25
    against ~0.6 s of CPU for SmolLM2 on one thread, the same bits); else torch's ops."""
    if source.kind == "gguf":
        yield from _iter_gguf(source.path, cfg, widen or _widen_torch)
    else:
        yield from _iter_safetensors(source.path)


def _unpermute(w: Any, n_head: int) -> Any:
    """Inverse of llama.cpp's convert permute: interleaved RoPE rows back to rotate-half (a
    numpy array or a torch tensor)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ggml block types dequantized in torch (the rest through gguf's numpy code): bytes a block
BLOCKS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_blocks(data: np.ndarray, kind: str) -> torch.Tensor:
    """gguf.quants.dequantize for Q4_0, Q4_1 and Q8_0, as float32 (flat): the same
    elementwise float32 operations in the same order (d * q, then + m), so the same bits
    (tests/unit/test_quant.py checks), but on torch's threads and without gguf's per-16-row
    numpy passes (SmolLM2: ~1.2 s of every node's start, ~0.3 s this way)."""
    # a writable copy: the file's pages are mapped read-only (torch warns on those)
    blocks = torch.from_numpy(np.require(data, np.uint8, ["C", "W"])).view(-1, BLOCKS[kind])
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).view(-1)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # low nibbles are the first 16 of a block
    if kind == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).view(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + m).view(-1)


def _widen_torch(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    return dequantize_blocks(data, kind).view(shape)


def _iter_gguf(path: Path, cfg: ModelConfig, widen: Widen) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_gguf(path)
    for tensor in reader.tensors:
        name = tensor.name
        if name in GGUF_TOP_NAMES:
            hf_name = GGUF_TOP_NAMES[name]
        elif name.startswith("blk."):
            parts = name.split(".", 3)
            if len(parts) != 4:
                raise ModelLoadError(f"{path}: tensor {name!r} is not named blk.N.KIND.SUFFIX")
            _, idx, kind, suffix = parts
            if kind not in GGUF_LAYER_NAMES:
                continue  # not a weight (the RoPE factors are the config's: rope_scaling)
            hf_name = f"model.layers.{idx}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
        else:  # rope_freqs.weight: read with the metadata into the config's rope_scaling
            continue
        try:
            qtype = GGMLQuantizationType(tensor.tensor_type)
            data = np.asarray(tensor.data)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            if qtype.name in BLOCKS:
                weight = widen(data, qtype.name, shape)
            elif qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                weight = torch.from_numpy(data.astype(np.float32).reshape(shape))
            else:
                weight = torch.from_numpy(dequantize(data, qtype).reshape(shape))
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot dequantize tensor {name}: {exc}") from exc
        if name.endswith("attn_q.weight"):
            weight = _unpermute(weight, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            weight = _unpermute(weight, cfg.num_kv_heads)
        yield hf_name, weight.contiguous()


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file} is named in the index but missing")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{file} is not a valid safetensors file: {exc}") from exc
