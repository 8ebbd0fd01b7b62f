"""The KV backends by name: the registry of common/kv's connectors.

Kept apart from that package (which imports the engine's types) so that the configuration
can check `--kv-backend` without an import circle. Adding a backend: its module, one line here.
"""

from __future__ import annotations

# name -> module defining CONNECTOR (imported on first use: ucx pulls in ucxx)
BACKENDS: dict[str, str] = {
    "zmq": "pdserve.common.kv.zmq_parts",
    "tcp": "pdserve.common.kv.tcp",
    "shm": "pdserve.common.kv.shm",
    "shm_direct": "pdserve.common.kv.shm_direct",
    "cuda_ipc": "pdserve.common.kv.cuda_ipc",
    "ucx": "pdserve.common.kv.ucx",
}
CHOICES = ("auto", *BACKENDS)
