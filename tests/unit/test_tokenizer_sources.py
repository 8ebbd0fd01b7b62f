"""Tokenizers read from a GGUF file or a Hugging Face folder tokenize as the model's own
tokenizer does (transformers' GGUF converter, llama.cpp, AutoTokenizer): the splits its
merges were learned on, user-defined tokens kept as text, a BOS its post-processor adds."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from pdserve.common.model.tokenizer import Tokenizer

# a byte-level vocabulary: "(" "x" merge into "(x"; "<think>" is user-defined (type 4)
TOKENS = ["<s>", "</s>", "(", "x", "(x", "f", ")", "a", "b", "<think>"]
TYPES = [3, 3, 1, 1, 1, 1, 1, 1, 1, 4]


def _gguf(tmp_path: Path, pre: str) -> Path:
    path = tmp_path / f"{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(["( x"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_llama3_gguf_splits_as_llama3_and_a_gpt2_one_as_gpt2(tmp_path):
    """GPT-2's splits cut "f(x)" before "(x": the merge never applied (the model was fed
    ids it was never trained on). Llama 3's keep "(x" whole."""
    ids = {t: i for i, t in enumerate(TOKENS)}
    llama3 = Tokenizer.load(str(_gguf(tmp_path, "llama-bpe")))
    assert llama3.encode("f(x)", add_special_tokens=False) == [ids["f"], ids["(x"], ids[")"]]
    gpt2 = Tokenizer.load(str(_gguf(tmp_path, "gpt2")))
    assert gpt2.encode("f(x)", add_special_tokens=False) == [
        ids["f"], ids["("], ids["x"], ids[")"]]  # fmt: skip
    again = Tokenizer.load(str(_gguf(tmp_path, "llama-bpe")))  # from the cache: the same
    assert again.encode("f(x)", add_special_tokens=False) == [ids["f"], ids["(x"], ids[")"]]


def test_user_defined_tokens_are_text_and_control_tokens_are_skipped(tmp_path):
    tok = Tokenizer.load(str(_gguf(tmp_path, "llama-bpe")))
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("a<think>b", add_special_tokens=False) == [ids["a"], ids["<think>"], ids["b"]]
    assert tok.decode([ids["a"], ids["<think>"], ids["b"], ids["</s>"]]) == "a<think>b"


def test_a_bos_added_by_the_post_processor_is_added(tmp_path, tokenizer):
    """Llama 3's tokenizer_config.json has no add_bos_token: its BOS comes from
    tokenizer.json's post-processor, which AutoTokenizer and vLLM apply. Prompts went out
    without it."""
    from tokenizers import processors

    folder = tmp_path / "m"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    backend = tokenizer.backend
    bos = backend.token_to_id("<|im_start|>")
    backend.save(str(folder / "tokenizer.json"))
    assert Tokenizer.load(str(folder)).encode("hi") == tokenizer.encode("hi")  # none added
    with_bos = Tokenizer.load(str(folder)).backend
    with_bos.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    with_bos.save(str(folder / "tokenizer.json"))
    ids = Tokenizer.load(str(folder)).encode("hi")
    assert ids == [bos, *tokenizer.encode("hi", add_special_tokens=False)]
    assert Tokenizer.load(str(folder)).encode("hi", add_special_tokens=False) == ids[1:]


def test_the_split_table_is_transformers_and_an_unknown_name_is_said(tmp_path, caplog):
    from pdserve.common.model.pretokenize import GGUF_PRE_SPLITS

    # the reference table, where transformers keeps it (5.x; 4.x has none to compare with)
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for name, split in GGUF_PRE_SPLITS.items():  # the reference's regex, character for character
        assert mapping.GGUF_PRE_TOKENIZER_SPLITS[name] == split, name
    with caplog.at_level("WARNING"):
        Tokenizer.load(str(_gguf(tmp_path, "smollm")))
        assert "not known" not in caplog.text
        Tokenizer.load(str(_gguf(tmp_path, "qwen2")))  # a split it does not have
    assert "'qwen2' is not known here" in caplog.text
