"""Tokenizer and chat template, loaded from GGUF metadata or a Hugging Face folder (no torch).

The gateway tokenizes and detokenizes; nodes only see token ids. Both load the tokenizer
through this module so they agree, and `fingerprint()` lets the gateway check that at
registration. The GGUF path rebuilds the byte-level BPE from `tokenizer.ggml.*` exactly as
transformers' GGUF converter does, so ids match the Hugging Face reference.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from pdserve.common.errors import ModelLoadError
from pdserve.common.model import cache
from pdserve.common.model.config import ModelSource, gguf_field, open_gguf, resolve_model
from pdserve.common.model.gguf_meta import token_id, vocabulary
from pdserve.common.model.pretokenize import gguf_pre_tokenizer

log = logging.getLogger(__name__)
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4
CACHE_VERSION = 2  # in the cache key: entries built by older code are built again
_SURROGATE = re.compile("[\ud800-\udfff]")  # not UTF-8: tokenizers refuses such a str


@dataclass
class Tokenizer:
    backend: HFTokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    @classmethod
    def load(cls, model: str | ModelSource | None = None) -> Tokenizer:
        source = model if isinstance(model, ModelSource) else resolve_model(model)
        if source.kind == "gguf":
            name = cache.key(f"tokenizer-v{CACHE_VERSION}", source.path) + ".json"
            cached = cache.read(name)
            if cached is not None:
                try:
                    return cls._from_cached(cached)
                except Exception as exc:  # a cache must never break loading
                    log.warning("ignoring a broken tokenizer cache entry %s: %s", name, exc)
            tok = cls._from_gguf(source.path)
            cache.write(name, tok._to_cached())
            return tok
        return cls._from_hf(source.path)

    def _to_cached(self) -> str:
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id,
                "add_bos_token": self.add_bos_token,
                "chat_template": self.chat_template,
                # hashing the vocabulary is ~0.13 s of every process's start: once, here
                "fingerprint": self.fingerprint(),
            }
        )

    @classmethod
    def _from_cached(cls, text: str) -> Tokenizer:
        d = json.loads(text)
        tok = cls(
            backend=HFTokenizer.from_str(d["backend"]),
            eos_token_ids=tuple(d["eos_token_ids"]),
            bos_token_id=d["bos_token_id"],
            add_bos_token=bool(d["add_bos_token"]),
            chat_template=d["chat_template"],
        )
        tok._fingerprint = str(d.get("fingerprint", ""))  # an older entry: hashed when asked
        return tok

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while Rust works (a single `encode` holds it,
        # ~0.1 s per 100k tokens, stalling the gateway's event loop thread the whole time);
        # the _fast form skips character offsets nobody here reads
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        try:
            ids = list(batch([text], add_special_tokens=False)[0].ids)
        except TypeError:  # a lone surrogate (_SURROGATE)
            ids = list(batch([_valid_utf8(text)], add_special_tokens=False)[0].ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def surely_longer_than(self, text: str, tokens: int) -> bool:
        """True when `text` certainly encodes to more than `tokens` tokens, known without
        encoding it: a multi-megabyte prompt is refused in microseconds instead of holding
        a core (and, for the Python parts, the GIL the event loop needs) for seconds."""
        bound = self._chars_per_token
        return bound is not None and len(text) > (tokens + 1) * bound

    @functools.cached_property
    def _chars_per_token(self) -> int | None:
        """Most characters of input text one token can stand for, where that is provable;
        None where the pipeline may drop text (a whitespace-splitting pre-tokenizer, a
        normalizer that strips): those prompts are counted only by encoding them.

        Byte-level BPE maps each UTF-8 byte of the text to one character of a token, and
        a character is at least one byte, so a token covers at most as many characters as
        its longest vocabulary entry has. NFC composition shrinks text at most 3 to 1
        (three Hangul jamo into one syllable), hence the factor."""
        spec = json.loads(self.backend.to_str())
        norm = spec.get("normalizer")
        shrink = 1 if norm is None else {"NFC": 3}.get(norm.get("type"))
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        kinds = [step.get("type") for step in steps]
        keeps_text = all(
            k in ("ByteLevel", "Digits")
            or (k in ("Split", "Punctuation") and step.get("behavior") != "Removed")
            for k, step in zip(kinds, steps, strict=True)
        )
        if shrink is None or "ByteLevel" not in kinds or not keeps_text:
            return None
        longest = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return longest * shrink

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_to_str(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """`variables`: a request's own for the template (vLLM's `chat_template_kwargs`,
        `enable_thinking` say); the ones set here win."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: use /v1/completions instead")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        fixed = {"add_generation_prompt": add_generation_prompt, "messages": messages,
                 "bos_token": self._special_text(self.bos_token_id),
                 "eos_token": self._special_text(eos)}  # fmt: skip
        return render_chat_template(self.chat_template, **{**(variables or {}), **fixed})

    def fingerprint(self) -> str:
        """A short hash of the vocabulary, so processes can check they tokenize alike. Kept:
        a node sends it in every Register to every gateway, and hashing the vocabulary takes
        ~50 ms of CPU (with 16 nodes and 8 gateways on 2 cores, registering blocked each
        node's loop past the heartbeat timeout, and every drop re-registered)."""
        if not self._fingerprint:
            self._fingerprint = self._hash_vocab()
        return self._fingerprint

    def _hash_vocab(self) -> str:
        vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        digest = hashlib.sha256(json.dumps(vocab).encode())
        digest.update(repr((self.eos_token_ids, self.bos_token_id)).encode())
        return digest.hexdigest()[:16]

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        reader = open_gguf(path)
        if gguf_field(reader, "tokenizer.ggml.model") != "gpt2":
            raise ModelLoadError(
                f"{path}: only byte-level BPE ('gpt2') GGUF tokenizers are supported"
            )
        tokens, merges, types = vocabulary(path, functools.partial(gguf_field, reader))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = gguf_pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        kinds = list(zip(tokens, types, strict=True))
        # control tokens are special (skipped in output); user-defined ones are text that
        # stays whole (DeepSeek-R1's "<think>"), as llama.cpp prints them
        backend.add_special_tokens([
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in kinds if kind == GGUF_TOKEN_TYPE_CONTROL
        ])  # fmt: skip
        backend.add_tokens([
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in kinds if kind == GGUF_TOKEN_TYPE_USER_DEFINED
        ])  # fmt: skip
        keys = (f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "bos"))
        eos, eot, bos = (token_id(path, k, gguf_field(reader, k)) for k in keys)
        return cls(
            backend=backend,
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
            bos_token_id=bos,
            add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def _from_hf(cls, folder: Path) -> Tokenizer:
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_path))
        except Exception as exc:
            raise ModelLoadError(f"{tok_path} is not a valid tokenizer file: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()

        def token_id(name: str) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else backend.token_to_id(value)

        from pdserve.common.model.config import load_model_config

        model_cfg = load_model_config(ModelSource("hf", folder))
        eos_ids = list(model_cfg.eos_token_ids)
        cfg_eos = token_id("eos_token")
        if cfg_eos is not None and cfg_eos not in eos_ids:
            eos_ids.append(cfg_eos)
        bos = token_id("bos_token")
        if bos is None:
            bos = model_cfg.bos_token_id
        adds_bos = cfg.get("add_bos_token")
        if adds_bos is None and bos is not None:  # Llama 3: tokenizer.json's post-processor
            # adds it (AutoTokenizer and vLLM apply that); the config does not say
            probe = backend.encode("a", add_special_tokens=True).ids
            adds_bos = bool(probe) and probe[0] == bos
        return cls(
            backend=backend,
            eos_token_ids=tuple(eos_ids),
            bos_token_id=bos,
            add_bos_token=bool(adds_bos),
            chat_template=template,
        )


def _raise_exception(message: str) -> None:
    raise ValueError(message)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """A chat template compiles once per process (milliseconds each time otherwise); the
    compiled template renders safely from several threads."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # what transformers' (and so vLLM's) template environment has: `{% break %}`, the date
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    return env.from_string(template)


def render_chat_template(template: str, **variables: Any) -> str:
    try:
        return str(_compiled(template).render(**variables))
    except Exception as exc:  # a template's error, or one a request's variables provoke
        raise ValueError(f"chat template failed: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    vLLM's scheme: decode a short window before the new tokens (`prefix_offset`) and the
    window plus the new tokens, and emit the difference. A delta that ends in U+FFFD is an
    incomplete UTF-8 sequence; it is held back until the next token completes it.

    The first window is the prompt's last 5 tokens (the 6th back may be the tail of a split
    character): a SentencePiece decoder drops the space that starts a text, so the first
    token decoded alone would lose its own ("is" + "▁Paris" -> "isParis").
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids or [])[-6:]
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if full == prefix and self._skipped(token_id):
            # a special token (skipped: no text) changes no later decode; kept, a run of them
            # (under ignore_eos, say) grew the window, and each token decoded all of it again:
            # quadratic in the run, in the gateway's event loop
            self.ids.pop()
            return ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.prefix_offset > 64:  # keep the window short
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return delta
        return ""

    def _skipped(self, token_id: int) -> bool:
        decode = self.tokenizer.decode
        return decode([token_id]) == "" and decode([token_id], skip_special_tokens=False) != ""


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back what could be the start of one.

    OpenAI semantics: the text ends right before the first stop string, which is not
    included. Up to `longest - 1` characters are held back between chunks, and flushed with
    the next delta (or at the end) once they cannot begin a stop string.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` on a match."""
        if self.stopped:
            return ""
        text = self.pending + delta
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(i for i, _ in hits)]
        if not self.stops or self.holdback == 0:
            self.pending = ""
            return text
        keep = _longest_stop_prefix_suffix(text, self.stops)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Only the places where a stop's first character occurs can start one (found by
    `str.find`, in C): per token, the gateway's event loop pays for those, not for every
    length of every stop string."""
    best = 0
    for stop in stops:
        start = len(text) - min(len(stop) - 1, len(text))
        i = text.find(stop[0], start)
        while i != -1 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return best


def _valid_utf8(text: str) -> str:
    """Each lone surrogate as U+FFFD: a command line's invalid UTF-8 bytes come as surrogate
    escapes (`pdserve generate --prompt $'\\xff'`), a JSON string may hold "\\udcff"."""
    return _SURROGATE.sub("\ufffd", text)
