"""How a GGUF vocabulary's text is split before its merges (`tokenizer.ggml.pre`).

Merges never cross a split, so the splits must be the ones the merges were learned on:
with GPT-2's, "f(x)" is cut before "(x" and Llama 3's "(x" merge never applies (the model
is fed ids it never saw). The names are llama.cpp's, read as transformers' GGUF converter
reads them; any other name (SmolLM2's "smollm", "gpt2", ...) splits as GPT-2.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, pre_tokenizers

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS = dict.fromkeys(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
)


def gguf_pre_tokenizer(name: Any) -> Any:
    """The pre-tokenizer for a GGUF's `tokenizer.ggml.pre` (None: not given)."""
    split = GGUF_PRE_SPLITS.get(str(name or ""))
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
