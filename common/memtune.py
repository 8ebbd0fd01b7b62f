"""Process-wide memory settings for moving large KV frames.

glibc serves allocations above 128 KiB with fresh mmap()s and returns them on free, so every
received or exported multi-megabyte frame page-faults its way in again (measured 3-7x slower
than reused memory). Raising the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the
trim threshold keeps freed frames in the heap for the next one: ZeroMQ's receive buffers and
torch's frame tensors then reuse warm pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: 2^32 was cut to 0 (trim at every free)


def tune_malloc() -> bool:
    """Best effort; False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # a value past an int is an error, not cut
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    return ok and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
