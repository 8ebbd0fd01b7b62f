"""A GGUF's metadata as the loaders read it (common/model/config.py, gguf_meta.py,
tokenizer.py): RoPE as llama.cpp runs the file, `rope_freqs.weight`'s factors (Llama 3.1's
long-context scaling) and linear scaling applied, other scalings refused, the embedded SmolLM2
unchanged; and malformed fields a ModelLoadError naming the key, not a TypeError."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pdserve.common.engine.model import Rotary, rope_inv_freq
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.config import load_model_config, resolve_model
from pdserve.common.model.tokenizer import Tokenizer

HEAD_DIM, BASE = 8, 10000.0
FACTORS = [1.0, 2.0, 4.0, 8.0]  # head_dim / 2 of them
LLAMA = {"block_count": 1, "context_length": 64, "embedding_length": 16,
         "feed_forward_length": 32, "attention.head_count": 2, "attention.head_count_kv": 1,
         "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": BASE,
         "rope.dimension_count": HEAD_DIM, "vocab_size": 3}  # fmt: skip


def _gguf(tmp_path: Path, llama: dict[str, Any] | None = None, rope_freqs: Any = None,
          **tokenizer: Any) -> Path:  # fmt: skip
    """A tiny llama GGUF: `llama` overrides llama.* keys (None drops one), `tokenizer`
    tokenizer.ggml.* ones."""
    path = tmp_path / f"m{len(list(tmp_path.glob('*.gguf')))}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**LLAMA, **(llama or {})}.items():
        _add(writer, f"llama.{key}", value)
    toks = {"model": "gpt2", "tokens": ["a", "b", "c"], "token_type": [1, 1, 1],
            "eos_token_id": 2, **tokenizer}  # fmt: skip
    for key, value in toks.items():
        _add(writer, f"tokenizer.ggml.{key}", value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, value)


def _config(path: Path):
    return load_model_config(resolve_model(str(path)))


def _llama_cpp_angle(position: int, i: int, factor: float = 1.0) -> float:
    """ggml's rope: theta = p * base^(-2i/d) / freq_factors[i], times freq_scale (1/factor)."""
    return position * BASE ** (-2 * i / HEAD_DIM) / FACTORS[i] / factor


@pytest.mark.parametrize("linear", [None, 4.0])
def test_rope_freqs_and_linear_scaling_turn_the_angles_as_llama_cpp(tmp_path, linear):
    extra = {} if linear is None else {"rope.scaling.type": "linear", "rope.scaling.factor": linear}
    cfg = _config(_gguf(tmp_path, extra, rope_freqs=FACTORS))
    assert cfg.rope_scaling is not None and cfg.rope_scaling["freq_factors"] == tuple(FACTORS)
    rotary = Rotary(cfg, 64)
    for position in (1, 7, 63):
        want = [math.cos(_llama_cpp_angle(position, i, linear or 1.0)) for i in range(4)]
        got = rotary.cos[position, : HEAD_DIM // 2].double()
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-5)


def test_an_old_files_linear_key_scales_too_and_none_does_not(tmp_path):
    plain = rope_inv_freq(_config(_gguf(tmp_path)))
    old = _config(_gguf(tmp_path, {"rope.scale_linear": 2.0}))
    assert torch.equal(rope_inv_freq(old), plain / 2.0)
    none = _config(_gguf(tmp_path, {"rope.scaling.type": "none", "rope.scaling.factor": 8.0}))
    assert none.rope_scaling is None and torch.equal(rope_inv_freq(none), plain)


@pytest.mark.parametrize(
    ("extra", "freqs", "says"),
    [
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, None, "yarn"),
        ({"rope.scaling.attn_factor": 0.5}, None, "attn_factor"),
        ({}, [1.0, 2.0], "rope_freqs"),  # not head_dim / 2 of them
        ({}, [1.0, 0.0, 1.0, 1.0], "rope_freqs"),
    ],
)
def test_a_rope_it_cannot_run_is_refused_not_run_wrong(tmp_path, extra, freqs, says):
    with pytest.raises(ModelLoadError, match=says):
        _config(_gguf(tmp_path, extra, rope_freqs=freqs))


def test_the_embedded_model_has_no_rope_factors_and_keeps_its_angles():
    cfg = load_model_config(resolve_model(None))
    assert cfg.rope_scaling is None and cfg.head_dim == 64 and cfg.rope_theta == 100000.0
    plain = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(rope_inv_freq(cfg), plain)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"attention.head_count": [2, 2]}, "llama.attention.head_count"),  # per-layer counts
        ({"embedding_length": "16"}, "llama.embedding_length"),
        ({"attention.layer_norm_rms_epsilon": "tiny"}, "llama.attention.layer_norm_rms_epsilon"),
        ({"vocab_size": [3]}, "llama.vocab_size"),
        ({"context_length": None}, "lacks GGUF metadata llama.context_length"),
    ],
)
def test_malformed_model_metadata_is_a_load_error_naming_the_key(tmp_path, extra, key):
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")):
        _config(_gguf(tmp_path, extra))


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"tokens": None}, "tokenizer.ggml.tokens"),
        ({"token_type": [1, 1]}, "tokenizer.ggml.token_type"),
        ({"tokens": [1, 2, 3]}, "tokenizer.ggml.tokens"),
        ({"eos_token_id": "2"}, "tokenizer.ggml.eos_token_id"),
    ],
)
def test_malformed_tokenizer_metadata_is_a_load_error_naming_the_key(
    tmp_path, monkeypatch, fields, key
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")):
        Tokenizer.load(str(_gguf(tmp_path, **fields)))
