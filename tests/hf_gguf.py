"""transformers' GGUF loader, made to do its repeated work once (the reference side of the
parity and tokenizer tests): it parses the file's fields, a 49k-token vocabulary among them,
once for the config and again for the weights, and builds gguf's tensor-name map once per
module of the model (397 times for SmolLM2). Both are pure functions of their arguments, so
each is cached while transformers loads; and the reader slices a plain ndarray view of its
memory map, not the np.memmap itself, whose Python-level slicing ran on each of ~1.8M slices
(1.8 -> 0.5 s a parse; every field and tensor the same). What it loads is unchanged."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import gguf
import numpy as np


class _PlainViewReader(gguf.GGUFReader):
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = np.asarray(value)  # the same pages, as a base-class array


@contextmanager
def each_parse_once() -> Iterator[None]:
    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(_PlainViewReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield
