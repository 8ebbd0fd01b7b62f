"""`--device cuda:auto`: one GPU per replica when compose scales a service on one host.

Docker hands GPU 0 to every replica of a service that reserves `count: 1`, so compose
reserves all GPUs for each node and each replica takes its own: the replica number (from
PDSERVE_REPLICA, else from the compose container name PROJECT-SERVICE-N, see
common/container.py) minus one, plus `--gpu-offset` (decode replicas start after the prefill
replicas' GPUs), modulo the GPUs it can see. Torch-free until the end.
"""

from __future__ import annotations

import logging
import os

from pdserve.common.container import container_name, replica_from_name

log = logging.getLogger(__name__)


def replica_number() -> int:
    """1-based replica number of this container; 1 when it cannot be known."""
    env = os.environ.get("PDSERVE_REPLICA")
    if env:
        return int(env)
    name = container_name()
    return (replica_from_name(name) if name else None) or 1


def pick_gpu(replica: int, offset: int, count: int) -> int:
    return (replica - 1 + offset) % max(1, count)


def resolve_device(device: str, gpu_offset: int) -> str:
    if device != "cuda:auto":
        return device
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("--device cuda:auto: no CUDA device is visible")
    replica = replica_number()
    index = pick_gpu(replica, gpu_offset, count)
    log.info("replica %d takes cuda:%d of %d GPUs", replica, index, count)
    return f"cuda:{index}"
