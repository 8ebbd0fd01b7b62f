"""A GGUF file's metadata and tensors, read directly.

`gguf.GGUFReader` builds a numpy view for every part of every field: SmolLM2's 49k-token
vocabulary and 49k merges made that seconds per process (every node pays it at start). This
reads the same file in a small fraction of that: the header and
metadata with `struct`, numeric arrays with one `frombuffer` each, and the tensors as views of
one read-only memory map, exactly as GGUFReader lays them out (F32/F16/F64 and integer types
as their dtype, quantized types as rows of raw block bytes), so the loaders and
`gguf.quants.dequantize` take them unchanged (tests/unit/test_gguf_file.py compares the two).
Little-endian GGUF v2 and v3 (what llama.cpp writes), arrays of scalars or strings; anything
else (an array of arrays, say) is a ValueError, as is a file cut short. String arrays are
decoded when first read: a node's model config needs none of the vocabulary's ~100k strings
(its tokenizer is cached), and decoding them was ~0.25 s of every engine's start.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUF value types -> (struct code, numpy dtype); 8 is a string, 9 an array
SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
           4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
           10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}  # fmt: skip
STRING, ARRAY = 8, 9
# unquantized tensor types -> dtype (ggml: F32 0, F16 1, I8 24, I16 25, I32 26, I64 27, F64 28)
PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
         28: np.float64}  # fmt: skip


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int  # ggml's type number (gguf.GGMLQuantizationType(tensor_type))
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # numpy order (shape reversed); quantized: rows of block bytes


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, code: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        except struct.error as exc:  # past the end of a cut file
            raise ValueError(f"the file ends early: {exc}") from exc
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def strings(self, count: int) -> _Strings:
        """Steps over `count` strings (their lengths only), checking they fit the file."""
        start, pos, end, length = self.pos, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("a string array runs past the end of the file")
            pos += 8 + length(self.buf, pos)[0]
        if pos > end:
            raise ValueError("a string runs past the end of the file")
        self.pos = pos
        return _Strings(self.buf, start, count)

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item == STRING:
                return self.strings(count)
            if item not in SCALARS:
                raise ValueError(f"an array of GGUF type {item}")
            dtype = np.dtype(SCALARS[item][1]).newbyteorder("<")
            if self.pos + count * dtype.itemsize > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if kind not in SCALARS:
            raise ValueError(f"GGUF value type {kind}")
        return self.unpack(SCALARS[kind][0])


_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class _Strings:
    """Where a string array lies in the file, until it is read."""

    buf: memoryview
    pos: int
    count: int

    def decode(self) -> list[str]:
        cur = _Cursor(self.buf)
        cur.pos = self.pos
        return [cur.string() for _ in range(self.count)]


class Fields(Mapping[str, Any]):
    """Metadata key -> value; a string array is decoded at its first read, then kept."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, _Strings):
            value = self._values[key] = value.decode()
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class GgufFile:
    """`fields`: metadata key -> Python value (str, int, float, bool or a list of them);
    `tensors`: in file order, their data mapped read-only from the file."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        mapped = np.memmap(path, mode="r")
        cur = _Cursor(memoryview(mapped))  # type: ignore[arg-type]  # a memmap is a buffer
        if bytes(cur.buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (v2 and v3 little-endian are read)")
        n_tensors, n_fields = cur.unpack("Q"), cur.unpack("Q")
        self.fields = Fields()
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            if not 1 <= n_dims <= MAX_DIMS:  # a corrupt count read the rest of the file
                raise ValueError(f"tensor {name}: {n_dims} dimensions (GGUF has 1 to 4)")
            dims = tuple(cur.unpack("Q") for _ in range(n_dims))
            infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int):
            raise ValueError(f"general.alignment {align!r} is not an integer")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-cur.pos // align) * align
        self.tensors: list[GgufTensor] = []
        seen: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice")
            seen.add(name)
            shape = tuple(reversed(dims))
            n = int(np.prod(dims, dtype=np.int64))
            if kind in PLAIN:
                dtype, count = np.dtype(PLAIN[kind]), n
            else:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                if shape[-1] % block:
                    raise ValueError(f"tensor {name}: rows of {shape[-1]} in blocks of {block}")
                dtype, count = np.dtype(np.uint8), n // block * size
                shape = (*shape[:-1], shape[-1] // block * size)
            at = start + offset
            if at + count * dtype.itemsize > len(mapped):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(mapped, dtype, count, at).reshape(shape)
            self.tensors.append(GgufTensor(name, kind, dims, data))
