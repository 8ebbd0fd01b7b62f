"""transformers' GGUF model loader, made to do its repeated work once (the reference side of
the parity test): it parses the file's fields, a 49k-token vocabulary among them, once for
the config and again for the weights, and builds gguf's tensor-name map once per module of
the model (397 times for SmolLM2). Both are pure functions of their arguments, so each is
cached while transformers loads; what it loads is unchanged."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock


@contextmanager
def each_parse_once() -> Iterator[None]:
    import gguf

    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield
