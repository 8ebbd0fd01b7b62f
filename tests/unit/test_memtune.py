"""The benchmarks' malloc tuning (common/memtune.py) keeps a freed multi-megabyte frame in
the heap for the next one. Its trim threshold, 2^32, was cut to a C int's 0 by ctypes:
every free gave the memory back (the KV transfer figures were taken that way)."""

from __future__ import annotations

import subprocess
import sys

# in a process of its own: it changes malloc for the whole process
PROBE = """
import ctypes
from pdserve.common.memtune import tune_malloc
names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert tune_malloc()
frame = libc.malloc(8 << 20)  # under the 32 MiB mmap threshold: from the heap
ctypes.memset(frame, 1, 8 << 20)
held = libc.mallinfo2().arena
libc.free(frame)
print(held, libc.mallinfo2().arena)
"""


def test_a_freed_frame_stays_in_the_heap():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    held, after = map(int, done.stdout.split())
    assert held >= 8 << 20 and after == held  # trimmed: 1.7 MiB of the 9.7 MiB left
