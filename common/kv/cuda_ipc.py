"""The cuda_ipc backend: one GPU-to-GPU copy from the prefill node's paged cache into the
decode node's, on one host (NVLink or PCIe peer-to-peer; what NVLink boxes use).

The decode node shares its CUDA cache tensor through a CUDA IPC handle (torch's own
reduction, as torch.multiprocessing passes CUDA tensors between processes), advertised with
the UUID of the GPU it lives on. A prefill node on the same host (same identity) that sees
that GPU opens the handle once and copies each layer from its own blocks into the granted
ones on a side stream that first waits for the forward pass to have written the layer (an
event recorded as the layer lands); the copy is complete before the grant's lock is
released and the descriptor goes out (direct.py has the protocol and its safety rules).

Chosen by `auto` ahead of every other backend whenever both ends are CUDA caches on one
host; nothing here runs without a GPU (the CPU tests cover the shared protocol through
shm_direct; `make gpu-check` runs this one).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

from pdserve.common.engine.kv_cache import KVCache
from pdserve.common.kv.base import Backend, Transfer
from pdserve.common.kv.direct import DirectReceive, DirectSend, cache_of

# the fields of torch's rebuild_cuda_tensor arguments that travel (the rest are fixed here)
FIELDS = (
    "size",
    "stride",
    "offset",
    "handle",
    "storage_size",
    "storage_offset",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
BYTES = ("handle", "ref_counter_handle", "event_handle")


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpus() -> dict[str, int]:
    """UUID -> index of the GPUs this process sees."""
    if not torch.cuda.is_available():
        return {}
    return {gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}


class CudaIpcSend(DirectSend):
    name = "cuda_ipc"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.streams: dict[int, Any] = {}  # copy stream per source device

    def can_write(self, own: KVCache, shared: str) -> bool:
        if own.data.device.type != "cuda":
            return False
        peer = visible_gpus().get(shared.split(":", 1)[0])
        if peer is None:
            return False
        # another GPU only with peer access: without it a strided copy ends in a kernel on
        # the peer device's stream, which `copy`'s synchronize does not cover (the grant's
        # lock dropped, and the descriptor went, before the layer had landed)
        mine = own.data.device.index or 0
        return peer == mine or bool(torch.cuda.can_device_access_peer(mine, peer))

    def attach(self, shared: str, layout: tuple[int, ...], dtype: str) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid, blob = shared.split(":", 1)
        h = json.loads(base64.b64decode(blob))  # plain fields: nothing from a peer executes
        raw = {k: base64.b64decode(h[k]) if h[k] is not None else None for k in BYTES}
        data = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"],
            torch.UntypedStorage, getattr(torch, dtype),
            visible_gpus()[uuid],  # the device index as this process numbers it
            raw["handle"], h["storage_size"], h["storage_offset"], False,
            raw["ref_counter_handle"], h["ref_counter_offset"], raw["event_handle"],
            h["event_sync_required"],
        )  # fmt: skip
        if tuple(data.shape) != layout or str(data.dtype).removeprefix("torch.") != dtype:
            raise ValueError(f"cuda_ipc cache of shape {tuple(data.shape)}, expected {layout}")
        return data

    def mark(self, t: Transfer, layer: int) -> Any:
        own = cache_of(self.local)
        assert own is not None
        event = torch.cuda.Event()  # on the cache device's compute stream, after the layer
        event.record(torch.cuda.current_stream(own.data.device))  # KV was written
        return event

    def copy(self, own: KVCache, t: Transfer, layer: int, dst: KVCache, table: list[int],
             mark: Any) -> None:  # fmt: skip
        device = own.data.device
        index = device.index or 0
        if index not in self.streams:
            self.streams[index] = torch.cuda.Stream(device)
        stream = self.streams[index]
        with torch.cuda.stream(stream):
            if mark is not None:
                stream.wait_event(mark)
            own.copy_into(layer, t.block_table, t.num_tokens, dst, table)
        stream.synchronize()  # in place before the grant's lock drops and the descriptor goes


class CudaIpcReceive(DirectReceive):
    def share(self, cache: KVCache) -> str | None:
        if cache.data.device.type != "cuda" or cache_of(self.local) is not cache:
            return None
        from torch.multiprocessing.reductions import reduce_tensor

        _, a = reduce_tensor(cache.data)  # torch's own IPC export, as torch.multiprocessing
        fields = dict(zip(FIELDS, (list(a[1]), list(a[2]), a[3], a[7], a[8], a[9], a[11], a[12],
                                   a[13], a[14]), strict=True))  # fmt: skip
        for k in BYTES:
            fields[k] = base64.b64encode(fields[k]).decode() if fields[k] is not None else None
        blob = base64.b64encode(json.dumps(fields).encode()).decode()
        return f"{gpu_uuid(cache.data.device)}:{blob}"


CONNECTOR = Backend("cuda_ipc", CudaIpcSend, CudaIpcReceive, auto_rank=-2)
