"""The one staging path between a cache and host memory (common/engine/staging.py): the CPU
build runs the same calls the CUDA one does, and nothing else in the package touches a
tensor's memory through numpy or the buffer protocol (a CUDA tensor has none: it raises)."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest
import torch

from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.engine.staging import Staging, host_bytes

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "gateway", "prefill_node", "decode_node", "colocated_node", "planner",
            "loadgen")  # fmt: skip
ALLOWED = {("common/engine/staging.py", "host_bytes")}


def _tensor_memory_access(path: Path) -> list[tuple[str, int]]:
    """(function, line) of every `.numpy()` call (torch's way to a tensor's host memory)."""
    tree = ast.parse(path.read_text())
    hits = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "numpy" and not node.args:
                hits.append((fn.name, node.lineno))
    return hits


def test_only_host_bytes_reads_a_tensor_through_numpy():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for fn, line in _tensor_memory_access(path):
                if (rel, fn) not in ALLOWED:
                    found.append(f"{rel}:{line} in {fn}()")
    assert not found, "tensor memory read outside staging.host_bytes: " + ", ".join(found)
    assert _tensor_memory_access(ROOT / "common/engine/staging.py")  # the scan sees it there


def test_host_bytes_refuses_a_tensor_that_is_not_in_host_memory():
    with pytest.raises(ValueError, match="stage it to the host first"):
        host_bytes(torch.empty(4, device="meta"))
    t = torch.arange(6, dtype=torch.int32)
    assert bytes(host_bytes(t)) == t.numpy().tobytes()


def test_cpu_staging_is_a_view_out_and_a_view_in():
    staging = Staging(torch.device("cpu"))
    t = torch.randn(2, 5, 3)
    staged = staging.to_host(t)
    assert staged.done and staged.host.data_ptr() == t.data_ptr()  # no copy on CPU
    back = staging.to_device(bytearray(staged.bytes()), t.dtype, tuple(t.shape))
    assert torch.equal(back, t)
    staging.give_back(staged)


def test_a_cache_round_trips_frames_and_blocks_through_the_staging_path():
    cache = KVCache(4, 12, 16, 2, 8, torch.float32)
    cache.data.normal_(generator=torch.Generator().manual_seed(3))
    table = [9, 2, 7, 4]  # scattered: the gathered (staged) frame, not cache views
    frame = cache.export_frame(1, table, 50)
    staged = cache.stage_frame(1, table, 50)
    assert bytes(staged.bytes()) == bytes(frame)
    other = KVCache(4, 12, 16, 2, 8, torch.float32)
    other.import_kv(1, [0, 1, 3, 5], 50, frame)
    assert torch.equal(other.export_kv(1, [0, 1, 3, 5], 50), cache.export_kv(1, table, 50))
    block = cache.read_block(7)
    other.write_block(11, block)
    assert hashlib.sha256(other.read_block(11)).digest() == hashlib.sha256(block).digest()
    scattered = list(range(11, -1, -1))  # more runs than export_parts sends as views
    parts = cache.export_parts(2, scattered * 1, 12 * 16, max_parts=4)
    assert len(parts) == 1 and bytes(parts[0].bytes()) == bytes(
        cache.export_frame(2, scattered, 12 * 16)
    )


def test_the_buffer_pool_reuses_by_size_and_stays_bounded_across_threads():
    from concurrent.futures import ThreadPoolExecutor

    staging = Staging(torch.device("cpu"), max_free=4)  # the pool a CUDA cache uses
    a, b = staging._take(3 << 20), staging._take(1 << 20)
    assert (a.numel(), b.numel()) == (4 << 20, 1 << 20)  # powers of two, at least 1 MiB
    staging._put(a)
    staging._put(b)
    assert staging._take(2 << 20) is a and staging._take(1) is b  # smallest that fits

    def churn(seed: int) -> None:
        for i in range(200):
            staging._put(staging._take(((seed * 7 + i) % 5 + 1) << 19))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(churn, range(4)))
    assert len(staging.free) <= 4
