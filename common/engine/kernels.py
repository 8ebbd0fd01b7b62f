"""The fused CPU kernels of cpu_kernels.c: built on first use, loaded with ctypes.

Why C and not torch ops: a batch-1 decode step is dominated by the dispatch of ~2,000 tiny
ops, and these kernels do a layer's norms, RoPE, cache write, attention and SiLU in 5 calls
instead of ~45 (benchmarks/step_profile.py measures both). Why built here and not shipped:
`-march=native` code is right only for the CPU that compiled it, so the library is compiled
on the machine that runs it (about a second with gcc) and cached under
~/.cache/pdserve/kernels by a hash of the source, the compiler, its flags, its expansion of
`-march=native` and the CPU's flags (common/cbuild.py).

The build itself is torch-free (common/cbuild.py): config resolution reads its key too.
Where no C compiler is found (a slim container image) or the model does not fit the kernels'
limits, `load` returns the reason (the runner logs it), and the model runs its eager torch ops.
CUDA never uses these: they are CPU kernels on CPU tensors only (`load` checks the device).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from pathlib import Path
from typing import Any

import torch

from pdserve.common.cbuild import build, cache_dir, compile_flags  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 512  # rope_write's buffer on the C side
_loaded: dict[str, ctypes.CDLL] = {}

P, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, tuple[type[ctypes._SimpleCData[Any]], ...]] = {
    "rms_norm": (P, P, P, I64, I64, F32),
    "add_rms_norm": (P, P, P, P, I64, I64, F32),
    "silu_mul": (P, P, I64, I64),
    "rope_write": (P, P, P, P, P, P, P, I64, I64, I64, I64),
    "decode_attention": (P, I64, P, P, P, I64, P, P, I64, I64, I64, I64, I64, F32),
}

# gguf_matmul.c: float32 activations only
GGUF_SIGNATURES: dict[str, tuple[type[ctypes._SimpleCData[Any]], ...]] = {
    "gguf_matmul_f32": (P, I64, I64, P, I64, INT, P),
    "gguf_dequantize_f32": (P, I64, I64, INT, P),
    "gguf_matmul_path": (),
}


def _load(built: Path) -> ctypes.CDLL:
    """The library (after torch: its libgomp is the one this binds to). One that does not
    load (cut short by a crash or power loss mid-write) is built again, once: it was kept,
    and every start ran the eager ops."""
    try:
        return ctypes.CDLL(str(built))
    except OSError as first:
        if not any(cut in str(first) for cut in ("too short", "invalid ELF header")):
            raise  # a noexec cache, a missing library: building again changes nothing
        log.warning("the cached C kernels %s do not load (%s): building them again", built, first)
        built.unlink(missing_ok=True)
        again = build()
        if isinstance(again, str):
            raise OSError(again) from first
        return ctypes.CDLL(str(again))


def library() -> ctypes.CDLL | str:
    if "lib" not in _loaded:
        built = build()
        if isinstance(built, str):
            return built
        try:
            lib = _load(built)
        except OSError as e:  # e.g. a cache on a noexec mount
            return f"cannot load {built}: {e}"
        for suffix in SUFFIX.values():
            for name, args in SIGNATURES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes = list(args)
                fn.restype = ctypes.c_int if name == "decode_attention" else None
        for name, args in GGUF_SIGNATURES.items():
            getattr(lib, name).argtypes = list(args)
        lib.gguf_matmul_f32.restype = ctypes.c_int
        lib.gguf_dequantize_f32.restype = None
        lib.gguf_matmul_path.restype = ctypes.c_char_p  # "avx2", "neon" or "portable"
        _loaded["lib"] = lib
    return _loaded["lib"]


def _ptr(t: torch.Tensor) -> int:
    # the C reads host memory: a device tensor's pointer would crash the process, not raise
    assert t.is_cpu, f"a {t.device} tensor given to the CPU kernels"  # ~60 ns: ~700 a step
    return int(t.data_ptr())


def _rows(x: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if x.dim() != 2 or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(f"{what}: {tuple(x.shape)} {x.dtype}, not contiguous rows of {dtype}")


def _weight(w: torch.Tensor, x: torch.Tensor) -> None:
    if w.shape != x.shape[1:] or w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(f"a norm weight {tuple(w.shape)} {w.dtype} for {tuple(x.shape)} {x.dtype}")


def _cache(k: torch.Tensor, v: torch.Tensor, kvh: int, d: int, dtype: torch.dtype) -> None:
    if not (
        k.dim() == 3
        and k.shape[1:] == (kvh, d)
        and k.shape == v.shape
        and k.dtype == v.dtype == dtype
        and k.is_contiguous()
        and v.is_contiguous()
    ):
        raise ValueError(f"a KV cache {tuple(k.shape)} {k.dtype} for {kvh} heads of {d}")


def _indices(
    what: str, a: torch.Tensor, b: torch.Tensor, a_shape: tuple[int, ...],
    b_shape: tuple[int, ...] | None = None,
) -> None:  # fmt: skip
    """Index tensors the C code follows by pointer: int64, contiguous, of the shapes it reads."""
    shapes_fit = a.shape == a_shape and (b_shape is None or b.shape == b_shape)
    if not (shapes_fit and a.dtype == b.dtype == torch.int64
            and a.is_contiguous() and b.is_contiguous()):  # fmt: skip
        raise ValueError(f"{what}: {tuple(a.shape)} {a.dtype}, {tuple(b.shape)} {b.dtype}, "
                         f"not {a_shape} int64 contiguous")  # fmt: skip


def _rope_args(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    t: int, d: int,
) -> None:  # fmt: skip
    _indices("rope_write: positions and slots", positions, slots, (t,), (t,))
    _rows(cos, torch.float32, "rope_write's cos table")
    _rows(sin, torch.float32, "rope_write's sin table")
    if cos.shape != sin.shape or cos.shape[1] != d:
        raise ValueError(f"rope_write: tables {tuple(cos.shape)}, {tuple(sin.shape)} for {d}")


class CpuKernels:
    """The kernels for one dtype. Tensors must be CPU, of that dtype, and contiguous where
    the docstrings say so (the callers in model.py make them so). Every pointer the C follows
    is checked to span what it reads and writes (a ValueError, which `python -O` keeps, not an
    assert); the indices it follows are checked once a step (fused.py)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        suffix = SUFFIX[dtype]
        self._rms_norm = getattr(lib, f"rms_norm_{suffix}")
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._silu_mul = getattr(lib, f"silu_mul_{suffix}")
        self._rope_write = getattr(lib, f"rope_write_{suffix}")
        self._decode_attention = getattr(lib, f"decode_attention_{suffix}")
        # what passed the checks (kept, or weakly for caches: no other tensor takes their
        # ids): a step hands every layer the same positions, slots, tables and lengths, and
        # a layer its same cache views every step, so the layers after a step's first check
        # only their qkv (~2 us a call less)
        self._rope: tuple[object, ...] = ()
        self._attn: tuple[object, ...] = ()
        self._caches: dict[int, tuple[Any, Any, int, int]] = {}

    def _cache(self, k: torch.Tensor, v: torch.Tensor, kvh: int, d: int) -> None:
        seen = self._caches.get(id(k))
        if seen is None or seen[0]() is not k or seen[1]() is not v or seen[2:] != (kvh, d):
            _cache(k, v, kvh, d, self.dtype)
            if len(self._caches) > 4096:  # caches made again and again: forget the old
                self._caches.clear()
            self._caches[id(k)] = (weakref.ref(k), weakref.ref(v), kvh, d)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, n) contiguous, w (n,) -> a new (T, n)."""
        _rows(x, self.dtype, "rms_norm's x")
        _weight(w, x)
        out = torch.empty_like(x)
        self._rms_norm(_ptr(x), _ptr(w), _ptr(out), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place (both (T, n) contiguous); returns rms_norm(residual)."""
        _rows(residual, self.dtype, "add_rms_norm's residual")
        _rows(delta, self.dtype, "add_rms_norm's delta")
        if delta.shape != residual.shape:
            raise ValueError(
                f"add_rms_norm: delta {tuple(delta.shape)} for {tuple(residual.shape)}"
            )
        _weight(w, residual)
        out = torch.empty_like(residual)
        n = residual.shape[1]
        self._add_rms_norm(
            _ptr(residual), _ptr(delta), _ptr(w), _ptr(out), residual.shape[0], n, eps
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2I) contiguous -> silu(gate) * up, (T, I)."""
        _rows(gate_up, self.dtype, "silu_mul's gate_up")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=self.dtype)
        self._silu_mul(_ptr(gate_up), _ptr(out), rows, inter)
        return out

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        heads: tuple[int, int, int],
    ) -> None:
        """RoPE in place on qkv's Q and K (qkv (T, (H + 2 KVH) D) contiguous; cos and signed
        sin float32 (P, D); positions, slots int64 (T,)), then K and V to cache rows `slots`
        of k_cache, v_cache ((slots, KVH, D) contiguous each)."""
        h, kvh, d = heads
        _rows(qkv, self.dtype, "rope_write's qkv")
        if qkv.shape[1] != (h + 2 * kvh) * d or not 0 < d <= MAX_HEAD_DIM:
            raise ValueError(f"rope_write: qkv rows of {qkv.shape[1]} for heads {heads}")
        t = qkv.shape[0]
        seen = self._rope  # what the step's first layer checked: the same for the others
        if not (seen and seen[0] is positions and seen[1] is slots and seen[2] is cos
                and seen[3] is sin and seen[4] == t and seen[5] == d):  # fmt: skip
            _rope_args(cos, sin, positions, slots, t, d)
            self._rope = (positions, slots, cos, sin, t, d)
        self._cache(k_cache, v_cache, kvh, d)
        self._rope_write(
            _ptr(qkv), _ptr(cos), _ptr(sin), _ptr(positions), _ptr(slots), _ptr(k_cache),
            _ptr(v_cache), t, h, kvh, d,
        )  # fmt: skip

    def decode_attention(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        heads: tuple[int, int, int],
        block_size: int,
    ) -> torch.Tensor:
        """One query per sequence (the first H * D of each qkv row, (B, *) contiguous) against
        its first lens[b] cached tokens through block_tables (B, nb) -> (B, H * D)."""
        h, kvh, d = heads
        b, nb = block_tables.shape
        _rows(qkv, self.dtype, "decode_attention's qkv")
        if qkv.shape[0] != b or qkv.shape[1] < h * d or not 0 < d <= MAX_HEAD_DIM:
            raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} for {b} tables, {heads}")
        seen = self._attn
        if not (seen and seen[0] is block_tables and seen[1] is lens):
            _indices("decode_attention: lens and block tables", lens, block_tables, (b,))
        self._attn = (block_tables, lens)
        self._cache(k_cache, v_cache, kvh, d)
        out = torch.empty((b, h * d), dtype=self.dtype)
        status = self._decode_attention(
            _ptr(qkv), qkv.shape[1], _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), nb,
            _ptr(lens), _ptr(out), b, h, kvh, d, block_size, d**-0.5,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode attention: no memory for its score buffer")
        return out


def load(dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> CpuKernels | str:
    """The kernels for this engine, or why it runs eager torch ops instead."""
    if device.type != "cpu":
        return f"{device.type} runs torch's own kernels"
    if dtype not in SUFFIX:
        return f"no fused CPU kernels for {dtype} (float32 and bfloat16 only)"
    if head_dim > MAX_HEAD_DIM or head_dim % 2 or group < 1:
        return f"head_dim {head_dim}, GQA group {group}: beyond the kernels' limits"
    lib = library()
    if isinstance(lib, str):
        return lib
    return CpuKernels(lib, dtype)
