"""cuda_ipc writes another GPU's cache only where the two GPUs have peer access: without it a
strided cross-device copy ends in a kernel on the peer device's stream, which the writer's
synchronize does not wait for (the layer not landed when its grant's lock drops and its
descriptor goes; after an abort, a write into blocks given to another sequence). CPU-only:
the choice is the code's own, with the devices and their access given."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pdserve.common.kv import cuda_ipc


def test_another_gpu_is_written_only_with_peer_access(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: {"GPU-a": 0, "GPU-b": 1})
    access = {(0, 1): False}
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access[(a, b)])
    writer = cuda_ipc.CudaIpcSend.__new__(cuda_ipc.CudaIpcSend)
    own = SimpleNamespace(data=SimpleNamespace(device=torch.device("cuda", 0)))
    assert writer.can_write(own, "GPU-a:blob")  # the same GPU
    assert not writer.can_write(own, "GPU-b:blob")  # no peer access: shm instead
    access[(0, 1)] = True
    assert writer.can_write(own, "GPU-b:blob")
    assert not writer.can_write(own, "GPU-c:blob")  # not visible here
    cpu = SimpleNamespace(data=SimpleNamespace(device=torch.device("cpu")))
    assert not writer.can_write(cpu, "GPU-a:blob")
