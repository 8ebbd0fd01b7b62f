"""The KV backends by name: the registry of common/kv_transfer's connectors.

Kept apart from that package (which imports the engine's types) so that the configuration
can check `--kv-backend` without an import circle. Adding a backend: its module, one line here.
"""

from __future__ import annotations

# name -> module defining CONNECTOR (imported on first use: ucx pulls in ucxx)
BACKENDS: dict[str, str] = {
    "zmq": "pdserve.common.kv_transfer.zmq_parts",
    "tcp": "pdserve.common.kv_transfer.tcp",
    "shm": "pdserve.common.kv_transfer.shm",
    "shm_direct": "pdserve.common.kv_transfer.shm_direct",
    "cuda_ipc": "pdserve.common.kv_transfer.cuda_ipc",
    "ucx": "pdserve.common.kv_transfer.ucx",
}
CHOICES = ("auto", *BACKENDS)
