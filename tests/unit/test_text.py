"""Tokenizer, incremental detokenizer and stop strings (torch-free)."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdserve.common.model.tokenizer import IncrementalDetokenizer, StopStringMatcher


def stream(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + ("" if matcher.stopped else matcher.flush())


def test_stop_string_split_across_deltas_is_cut_before_it():
    m = StopStringMatcher(["END"])
    assert stream(m, ["hello E", "N", "D and more"]) == "hello "
    assert m.stopped


def test_partial_stop_prefix_is_held_back_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("ill") == "STill"
    assert not m.stopped


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo"])
    assert stream(m, ["hello world"]) == "hel"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abXY", max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_streamed_matching_equals_whole_text_matching(text, cuts):
    stops = ["XY", "aab"]
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert stream(StopStringMatcher(stops), pieces) == expected


def test_tokenizer_matches_hugging_face_reference(tokenizer):
    from transformers import AutoTokenizer

    from pdserve.common.model.config import default_model_path
    from tests.hf_gguf import each_parse_once

    path = default_model_path()
    with each_parse_once():  # the same tokenizer, its GGUF parsed in a third of the time
        ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    samples = [
        "Hello world 12345",
        "<|im_start|>user\nhi there<|im_end|>\n",
        "Ünïcödé — 你好, emoji 🙂 and tabs\tand  double  spaces",
        "def f(x):\n    return x**2  # comment",
    ]
    for text in samples:
        assert tokenizer.encode(text) == ref(text).input_ids, text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_incremental_detokenizer_reassembles_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # a text ending in bytes the vocabulary cannot complete stays held back, by design
    assume(not tokenizer.decode(ids).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Prefix:"))
    assert "".join(detok.add(i) for i in ids) == tokenizer.decode(ids)


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: "▁" marks a word's space, and the decoder
    drops the space that starts a text), as Llama-2, Mistral v0.1 and TinyLlama ship."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from pdserve.common.model.tokenizer import Tokenizer

    words = ["The", "capital", "of", "France", "is", "Paris", ".", "Hi"]
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(["\u2581" + w for w in words] + words)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, eos_token_ids=(), bos_token_id=None, add_bos_token=False,
                     chat_template=None)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(range(1, 17)), min_size=1, max_size=12), st.integers(0, 12))
def test_incremental_text_is_the_whole_texts_tail_for_a_sentencepiece_tokenizer(ids, cut):
    """The deltas after any prompt are what the whole text adds to the prompt's text: the
    first one keeps the space before its word (it lost it when decoded alone)."""
    tokenizer = _metaspace_tokenizer()
    prompt, out = ids[: min(cut, len(ids) - 1)], ids[min(cut, len(ids) - 1) :]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(detok.add(i) for i in out)
    whole, head = tokenizer.decode(ids), tokenizer.decode(prompt)
    assert whole.startswith(head)
    assert text == whole[len(head) :]


def test_the_first_word_after_a_prompt_keeps_its_space():
    tokenizer = _metaspace_tokenizer()
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    out = tokenizer.encode(" Paris", add_special_tokens=False)
    assert [detok.add(i) for i in out] == [" Paris"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc", max_size=12), st.lists(st.text(alphabet="abc", min_size=1,
       max_size=6), min_size=1, max_size=4))  # fmt: skip
def test_held_back_text_is_the_longest_suffix_that_could_start_a_stop(text, stops):
    from pdserve.common.model.tokenizer import _longest_stop_prefix_suffix

    expected = max(
        (n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
         if text.endswith(s[:n])),
        default=0,
    )  # fmt: skip
    assert _longest_stop_prefix_suffix(text, stops) == expected


def test_a_run_of_special_tokens_costs_each_token_one_short_decode(tokenizer):
    """Tokens with no text (special tokens, skipped) never advanced the window: under
    ignore_eos a run of EOS made every new token decode the whole run again (quadratic, in
    the gateway's event loop). The text is the whole decode's, and the decoded length stays
    bounded per token."""
    eos = tokenizer.eos_token_ids[0]
    words = tokenizer.encode("The sky is blue.", False)
    ids = [*words, *[eos] * 2000, *tokenizer.encode(" And the sea.", False)]
    decoded = 0
    real = tokenizer.decode

    def counting(ids_: list[int], skip_special_tokens: bool = True) -> str:
        nonlocal decoded
        decoded += len(ids_)
        return real(ids_, skip_special_tokens)

    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    detok.tokenizer = type("T", (), {"decode": staticmethod(counting)})()
    text = "".join(detok.add(t) for t in ids)
    assert text == tokenizer.decode([1, 2, 3, *ids])[len(tokenizer.decode([1, 2, 3])) :]
    assert decoded < 40 * len(ids)  # the run: ~2 windows of ~10 tokens each, not ~1,000


def test_lone_surrogates_encode_as_replacement_characters(tokenizer):
    """A command line's invalid UTF-8 (`pdserve generate --prompt $'\\xff'`: Python hands it
    over as the surrogate escape "\\udcff") and a JSON string's "\\ud800" raised a TypeError
    from tokenizers; each is the replacement character, as a UTF-8 reader decodes them."""
    want = tokenizer.encode("a\ufffdb")
    assert tokenizer.encode("a\udcffb") == want
    assert tokenizer.encode("a\ud800b") == want
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "\udcff"}])  # --chat
    assert tokenizer.encode(chat, add_special_tokens=False) == tokenizer.encode(
        chat.replace("\udcff", "\ufffd"), add_special_tokens=False
    )
