"""How a GGUF vocabulary's text is split before its merges (`tokenizer.ggml.pre`).

Merges never cross a split, so the splits must be the ones the merges were learned on:
with GPT-2's, "f(x)" is cut before "(x" and Llama 3's "(x" merge never applies (the model
is fed ids it never saw). The names are llama.cpp's, read as transformers' GGUF converter
reads them; any other name (SmolLM2's "smollm", "gpt2", ...) splits as GPT-2.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Regex, pre_tokenizers

log = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral NeMo's ("tekken", a llama-architecture GGUF)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe")  # fmt: skip
GGUF_PRE_SPLITS = {**dict.fromkeys(LLAMA3_NAMES, _LLAMA3_SPLIT), "tekken": _TEKKEN_SPLIT}
# names whose splits are GPT-2's (llama.cpp's), and the absence of one
GPT2_NAMES = ("", "gpt2", "gpt-2", "smollm", "phi-2", "roberta-bpe", "codeshell",
              "exaone", "minerva-7b")  # fmt: skip


def gguf_pre_tokenizer(name: Any) -> Any:
    """The pre-tokenizer for a GGUF's `tokenizer.ggml.pre` (None: not given)."""
    split = GGUF_PRE_SPLITS.get(str(name or ""))
    if split is None:
        if str(name or "") not in GPT2_NAMES:  # its own splits, unknown here: ids may differ
            log.warning("GGUF tokenizer.ggml.pre %r is not known here: split as GPT-2", name)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
