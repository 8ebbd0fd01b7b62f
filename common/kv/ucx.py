"""UCX payload channel (ucxx). Control stays on ZeroMQ; only frames travel here.

A prefill node connects one endpoint per decode peer and first sends its node id (64 bytes,
space padded), so the decode node knows whose frames arrive on it. Each frame is sent under
a tag made from its request id and layer, and the decode node, handling a KvLayer
descriptor, receives that tag's frame from that peer's endpoint into a reused buffer: a
frame skipped (its transfer forgotten), late (a receive timed out) or lost (a send failed)
cannot shift another transfer's frames into the wrong blocks, as frames matched by their
order alone did.
On a GPU box UCX picks RDMA or NVLink (`UCX_TLS`); here it runs over TCP loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from typing import Any

import numpy as np

from pdserve.common.kv.base import (
    Backend,
    Intake,
    Local,
    ReceiveConnector,
    SendConnector,
    Transfer,
)
from pdserve.common.node_id import ID_BYTES  # the id field opening an endpoint
from pdserve.common.wire.address import host_port, split_host_port

HELLO_S = 10.0  # for a new endpoint's node id
log = logging.getLogger(__name__)


def frame_tag(request_id: str, layer: int) -> int:
    """The UCX tag of a frame. An int below 2**61 - 1: ucxx mixes the tag in with Python's
    `hash()`, which is the int itself there, and differs between processes for a str."""
    digest = hashlib.blake2b(f"{request_id}\0{layer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 4


@functools.cache  # one import attempt: a forced ucx asks on every transfer
def available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA/UCX install
        return False
    return True


async def connect(address: str, node_id: str) -> Any:
    import ucxx

    ep = await ucxx.create_endpoint(*split_host_port(address))
    await ep.send(np.frombuffer(node_id.encode()[:ID_BYTES].ljust(ID_BYTES), dtype=np.uint8))
    return ep


class UcxListener:
    """Decode side: accepts prefill endpoints and receives their frames on request."""

    def __init__(self, host: str, port: int = 0) -> None:
        import ucxx

        self.endpoints: dict[str, Any] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.buffer = np.empty(0, dtype=np.uint8)
        self.listener = ucxx.create_listener(self._on_connect, port=port)
        self.address = host_port(host, self.listener.port)

    async def _on_connect(self, ep: Any) -> None:
        ident = np.empty(ID_BYTES, dtype=np.uint8)
        try:  # a stranger's bytes, or nothing in time: its endpoint closed, no peer named
            await asyncio.wait_for(ep.recv(ident), HELLO_S)
            peer = ident.tobytes().decode().strip()
        except Exception as exc:
            log.warning("UCX connection without a node id: %r", exc)
            with contextlib.suppress(Exception):
                await ep.close()
            return
        self.endpoints[peer] = ep
        self.arrived.setdefault(peer, asyncio.Event()).set()

    async def recv(self, peer: str, size: int, tag: int) -> memoryview:
        """The frame `tag` from `peer`, in a buffer reused across frames (valid until the next
        call)."""
        await self.arrived.setdefault(peer, asyncio.Event()).wait()
        if self.buffer.size < size:
            self.buffer = np.empty(size, dtype=np.uint8)
        view = self.buffer[:size]
        try:
            await self.endpoints[peer].recv(view, tag=tag)
        except BaseException:
            # a receive cancelled (timed out) may still complete later, into this buffer:
            # the next frame gets another one
            self.buffer = np.empty(0, dtype=np.uint8)
            raise
        return memoryview(view.data)

    async def close(self) -> None:
        for ep in self.endpoints.values():
            try:
                await ep.close()
            except Exception:
                pass
        self.listener.close()


class UcxSend(SendConnector):
    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.endpoints: dict[str, tuple[str, Any]] = {}  # by decode node id: address, ep

    def usable(self, endpoint: str) -> bool:
        # a sender without ucxx: every transfer timed out where another backend would do
        return bool(endpoint) and available()

    def stage(self, t: Transfer, layer: int) -> Any:
        return self.local.kv.export_frame(layer, t.block_table, t.num_tokens)

    async def send(self, t: Transfer, layer: int, payload: Any) -> None:
        address = t.target.kv_endpoints["ucx"]
        known = self.endpoints.get(t.target.node_id)
        if known is None or known[0] != address:  # first use, or the node restarted
            ep = await connect(address, self.local.node_id)
            self.endpoints[t.target.node_id] = (address, ep)
        else:
            ep = known[1]
        try:  # bounded: a large frame's send waits for its receive, which may never come
            await asyncio.wait_for(
                ep.send(payload, tag=frame_tag(t.request_id, layer)), self.local.timeout
            )
        except Exception as exc:  # a broken endpoint stays broken: the next frame connects again
            self.endpoints.pop(t.target.node_id, None)
            with contextlib.suppress(Exception):
                await ep.close()
            raise OSError(f"UCX frame of {t.request_id} to {t.target.node_id}: {exc!r}") from exc

    async def close(self) -> None:
        for _, ep in self.endpoints.values():
            try:
                await ep.close()
            except Exception:  # the peer may be gone already
                pass


class UcxReceive(ReceiveConnector):
    # a dropped transfer's frames are still received (and dropped): a large one's send waits
    # for its receive, and unreceived small ones would pile up in UCX's unexpected queue
    drains_after_drop = True

    def __init__(self, local: Local) -> None:
        super().__init__(local)
        self.listener: UcxListener | None = None

    async def listen(self, sink: Any) -> str:
        if self.local.forced != "ucx":  # opened only when asked for (it is slower over TCP)
            return ""
        self.listener = UcxListener(self.local.advertise_host, self.local.ports.get("ucx", 0))
        return self.listener.address

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        assert self.listener is not None
        h = rec.header
        tag = frame_tag(h.request_id, layer)
        return await asyncio.wait_for(
            self.listener.recv(h.prefill_node, h.frame_bytes, tag), self.local.timeout
        )

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()


CONNECTOR = Backend("ucx", UcxSend, UcxReceive)
