"""Model and tokenizer loading: both formats, and clear errors for bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.config import ModelSource, load_model_config, resolve_model
from pdserve.common.model.tokenizer import Tokenizer


def test_default_model_is_the_embedded_smollm2():
    source = resolve_model(None)
    cfg = load_model_config(source)
    assert source.kind == "gguf" and source.model_id == "SmolLM2-135M-Instruct"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.kv_bytes_per_token(4) == 46080 and cfg.kv_bytes_per_token(2) == 23040


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: p / "nothing-here", "does not exist"),
        (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", "not a .gguf file"),
        (
            lambda p: (p / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 64) and p / "bad.gguf",
            "not a readable GGUF",
        ),
        (lambda p: p, "without config.json"),
    ],
)
def test_bad_model_paths_are_clear_errors(tmp_path, make, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model_config(resolve_model(str(make(tmp_path))))


def hf_folder(tmp_path, config: dict):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_unsupported_architecture_is_named(tmp_path):
    folder = hf_folder(tmp_path, {**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model_config(resolve_model(str(folder)))


def test_missing_and_corrupt_weights(tmp_path):
    from pdserve.common.engine.runner import ModelRunner

    folder = hf_folder(tmp_path, LLAMA)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        ModelRunner(EngineConfig(model=str(folder), num_kv_blocks=4))
    (folder / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{corrupt")
    with pytest.raises(ModelLoadError, match="not a valid safetensors"):
        ModelRunner(EngineConfig(model=str(folder), num_kv_blocks=4))


def test_hf_folder_tokenizer_and_chat_template(tmp_path, tokenizer):
    folder = hf_folder(tmp_path, {**LLAMA, "eos_token_id": 2, "bos_token_id": 1})
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer.load(str(folder))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tokenizer.chat_template,
                "eos_token": "<|im_end|>",
                "bos_token": "<|im_start|>",
            }
        )
    )
    hf_tok = Tokenizer.load(str(folder))
    text = "Hello, world! 123"
    assert hf_tok.encode(text) == tokenizer.encode(text)
    assert hf_tok.eos_token_ids == (2,)
    msgs = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
    assert hf_tok.fingerprint() == tokenizer.fingerprint()


def test_truncated_gguf_is_a_clear_error(tmp_path):
    src = resolve_model(None).path
    bad = tmp_path / "trunc.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1_000_000))
    with pytest.raises(ModelLoadError):
        load_model_config(resolve_model(str(bad)))


def test_generate_cli_prints_only_the_text(smol_runner, tokenizer):
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.sampling import SamplingParams

    exe = shutil.which("pdserve") or f"{sys.executable} -m pdserve.cli"
    cmd = [
        *exe.split(),
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "12",
        # one thread (2 spin on a busy core) and a small KV cache (1 GiB by default, zeroed
        # at start): neither is what this test checks
        "--num-threads",
        "1",
        "--kv-cache-gb",
        "0.05",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    engine = LLMEngine(EngineConfig(num_kv_blocks=smol_runner.num_blocks), smol_runner, tokenizer)
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        ),
        add_special_tokens=False,
    )
    expected = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert out == expected + "\n"
    bad = subprocess.run(
        [*exe.split(), "generate", "--prompt", "x", "--model", "/no/such"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr and bad.stdout == ""


def test_the_gguf_tokenizer_cache_gives_the_same_tokenizer_and_survives_corruption(
    tmp_path, monkeypatch
):
    from pdserve.common.model import cache
    from pdserve.common.model.config import resolve_model
    from pdserve.common.model.tokenizer import CACHE_VERSION

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    fresh = Tokenizer.load(None)  # parses the GGUF, writes the entry
    (entry,) = tmp_path.iterdir()
    assert (
        entry.name == cache.key(f"tokenizer-v{CACHE_VERSION}", resolve_model(None).path) + ".json"
    )
    cached = Tokenizer.load(None)
    text = "Hello <|im_start|>user\nwörld 123<|im_end|>"
    assert cached.encode(text) == fresh.encode(text)
    assert cached.decode(fresh.encode(text)) == fresh.decode(fresh.encode(text))
    assert cached.fingerprint() == fresh.fingerprint()  # kept in the entry: not hashed again
    assert replace(cached).fingerprint() == cached.fingerprint()  # and the backend's hash
    assert (cached.chat_template, cached.eos_token_ids) == (
        fresh.chat_template,
        fresh.eos_token_ids,
    )
    entry.write_text("{not json")
    assert Tokenizer.load(None).fingerprint() == fresh.fingerprint()  # re-derived


def _gguf(path, fields: dict) -> str:
    """A GGUF v3 file with these metadata fields (str or uint32) and no tensors."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    for key, value in fields.items():
        kind, raw = (8, text(value)) if isinstance(value, str) else (4, struct.pack("<I", value))
        out += text(key) + struct.pack("<I", kind) + raw
    path.write_bytes(out)
    return str(path)


LLAMA_GGUF = {"general.architecture": "llama", "llama.attention.head_count": 4,
              "llama.embedding_length": 32, "llama.feed_forward_length": 64,
              "llama.block_count": 2, "llama.vocab_size": 100, "llama.context_length": 256,
              "llama.attention.layer_norm_rms_epsilon": 0}  # fmt: skip


@pytest.mark.parametrize(
    "fields,match",
    [
        ({**LLAMA_GGUF, "general.alignment": 0}, "not a readable GGUF.*alignment"),
        ({**LLAMA_GGUF, "llama.attention.head_count": 0}, "not usable.*num_heads=0"),
        ({**LLAMA_GGUF, "llama.block_count": 0}, "not usable.*num_layers=0"),
        ({**LLAMA_GGUF, "llama.context_length": 1 << 28}, "not usable.*max_position"),
    ],
)
def test_malformed_gguf_metadata_is_a_clear_error(tmp_path, fields, match):
    """An alignment of 0 or a head count of 0 raised ZeroDivisionError (a traceback, not a
    ModelLoadError); a context length of 2^28 allocated rotary tables of several GiB."""
    from pdserve.common.model.config import open_gguf

    open_gguf.cache_clear()
    with pytest.raises(ModelLoadError, match=match):
        load_model_config(resolve_model(_gguf(tmp_path / "m.gguf", fields)))


def test_a_config_json_with_no_heads_is_a_clear_error(tmp_path):
    folder = hf_folder(tmp_path, {**LLAMA, "num_attention_heads": 0})
    with pytest.raises(ModelLoadError, match="num_heads=0"):
        load_model_config(resolve_model(str(folder)))


@pytest.mark.parametrize(
    "name,model_id",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Qwen2.5-7B-Instruct-Q4_K_M.gguf", "Qwen2.5-7B-Instruct"),  # was "Qwen2"
        ("Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf", "Qwen2.5-Coder-7B-Instruct"),  # was too
        ("Mistral-7B-v0.3.BF16.gguf", "Mistral-7B-v0.3"),
        ("Llama-3.2-1B.gguf", "Llama-3.2-1B"),
    ],
)
def test_a_gguf_is_named_by_its_file_without_the_quantization_tag(name, model_id):
    """The name salts the prefix cache's hashes: two models cut to one name ("Qwen2") with
    the same layout and tokenizer joined one cluster and served each other's KV."""
    assert ModelSource("gguf", Path(name)).model_id == model_id


def test_other_weights_under_the_same_name_are_another_kv_layout(tmp_path):
    """A fine-tune (here: one weight byte changed) or another quantization of one model,
    under its name: the KV it makes differs, so its nodes do not join the others' cluster
    (the gateway compares the KV layout's fingerprint, which now covers the weights)."""
    source = resolve_model(None)
    copy = tmp_path / source.path.name
    shutil.copyfile(source.path, copy)
    same = load_model_config(resolve_model(str(copy))).layout_fingerprint()
    assert same == load_model_config(source).layout_fingerprint()
    with copy.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    tuned = resolve_model(str(copy))
    assert tuned.model_id == source.model_id
    assert load_model_config(tuned).layout_fingerprint() != same
