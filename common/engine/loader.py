"""Weights from a GGUF file (dequantized with `gguf`) or a Hugging Face safetensors folder.

Both paths yield tensors under Hugging Face's Llama names, so the model has one loading
routine. GGUF stores Q and K rows permuted for llama.cpp's interleaved RoPE; we undo that
permutation (as transformers' GGUF loader does) because the model uses the rotate-half form.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pdserve.common.errors import ModelLoadError
from pdserve.common.model_config import ModelConfig, ModelSource, open_gguf

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


def iter_weights(source: ModelSource, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float tensor) for every weight of the model."""
    if source.kind == "gguf":
        yield from _iter_gguf(source.path, cfg)
    else:
        yield from _iter_safetensors(source.path)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: interleaved RoPE rows back to rotate-half."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_gguf(path)
    for tensor in reader.tensors:
        name = tensor.name
        if name in GGUF_TOP_NAMES:
            hf_name = GGUF_TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind not in GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs: computed from metadata instead
            hf_name = f"model.layers.{idx}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
        else:
            continue
        try:
            qtype = GGMLQuantizationType(tensor.tensor_type)
            data = np.asarray(tensor.data)
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = data.astype(np.float32)
            else:
                array = dequantize(data, qtype)
            shape = tuple(int(d) for d in reversed(tensor.shape))
            array = array.reshape(shape)
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot dequantize tensor {name}: {exc}") from exc
        if name.endswith("attn_q.weight"):
            array = _unpermute(array, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            array = _unpermute(array, cfg.num_kv_heads)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(array))


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
