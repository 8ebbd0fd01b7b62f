"""The tokenizer's no-encode length bound: never claims a prompt too long that is not."""

from __future__ import annotations

import random

import pytest

from pdserve.common.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


def test_bound_never_refuses_a_prompt_that_fits(tok: Tokenizer) -> None:
    rng = random.Random(5)
    alphabet = ["#", "\n", " ", "a", "é", "語", "\U0001f600", "<|im_start|>", "ĠĠ", "lorem "]
    for _ in range(200):
        runs = range(rng.randint(1, 30))
        text = "".join(rng.choice(alphabet) * rng.randint(1, 300) for _ in runs)
        n = len(tok.encode(text, add_special_tokens=False))
        # at exactly its own length, or any limit above, the bound must not fire
        assert not tok.surely_longer_than(text, n)
        assert not tok.surely_longer_than(text, n + 7)


def test_bound_refuses_a_megabyte_prompt_without_encoding_it(tok: Tokenizer) -> None:
    text = "lorem ipsum " * 100_000
    assert tok.surely_longer_than(text, 4096)
    assert not tok.surely_longer_than("lorem ipsum", 4096)
    # runs of the vocabulary's longest entries: the case closest to the bound
    hashes = "#" * 80 * 50
    assert not tok.surely_longer_than(hashes, len(tok.encode(hashes, add_special_tokens=False)))


def test_no_bound_for_a_pipeline_that_may_drop_text(tok: Tokenizer) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    backend = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace: no bound
    other = Tokenizer(backend, (), None, False, None)
    assert not other.surely_longer_than(" " * 1_000_000, 10)
