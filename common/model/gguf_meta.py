"""A GGUF file's metadata values checked for what the loaders take them as: a malformed file
(a list where a count goes, a string, a token list of the wrong length) is a ModelLoadError
naming the key, not a TypeError or ValueError from deep in the load. Torch-free."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.common.errors import ModelLoadError
from pdserve.common.logs import cut


def number(path: Path, key: str, value: Any, kind: type[int] | type[float]) -> Any:
    """`value` (of metadata `key`) as `kind`: a finite int or float (an int: of integral
    value); a bool, a string, a list, NaN or infinity is refused."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and math.isfinite(value) and (kind is float or value == int(value)):
        return kind(value)
    raise ModelLoadError(f"{path}: GGUF metadata {key} is {cut(repr(value))}, not {kind.__name__}")


def token_id(path: Path, key: str, value: Any) -> int | None:
    """`value` (of metadata `key`) as a token id (None stays None)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ModelLoadError(f"{path}: GGUF metadata {key} is {cut(repr(value))}, not a token id")


def listed(path: Path, key: str, value: Any, kind: type) -> list[Any]:
    """`value` (of metadata `key`) as a list of `kind` (None: [])."""
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise ModelLoadError(f"{path}: GGUF metadata {key} is not a list of {kind.__name__}")
    return value


def vocabulary(path: Path, field: Callable[[str], Any]) -> tuple[list[str], list[str], list[int]]:
    """tokenizer.ggml's tokens, merges and token types (all 1 where absent), read by `field`."""
    key = "tokenizer.ggml.tokens"
    tokens = listed(path, key, field(key), str)
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata {key} is missing or empty")
    merges = listed(path, "tokenizer.ggml.merges", field("tokenizer.ggml.merges"), str)
    key = "tokenizer.ggml.token_type"
    types = listed(path, key, field(key), int) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{path}: GGUF metadata {key}: {len(types)} for {len(tokens)} tokens")
    return tokens, merges, types
