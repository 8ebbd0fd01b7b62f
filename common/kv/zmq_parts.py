"""The zmq backend: each layer's frame rides as extra parts of its KvLayer message on the
ZeroMQ data channel, sent with copy=False from views of the prefill node's paged cache (one
part per run of consecutive blocks). The decode node copies it from ZeroMQ's receive buffers
into its cache: one copy more than tcp on the receiving side, because libzmq owns its receive
buffers. Every decode node offers it (its data socket is always there): the fallback when a
peer cannot take the backend asked for."""

from __future__ import annotations

from typing import Any

from pdserve.common.kv.base import (
    Backend,
    Intake,
    ReceiveConnector,
    SendConnector,
    Transfer,
)


class ZmqSend(SendConnector):
    def descriptor(self, t: Transfer, layer: int, payload: Any) -> list[Any] | None:
        return list(payload)  # the frame's parts follow the descriptor, zero-copy


class ZmqReceive(ReceiveConnector):
    async def listen(self, sink: Any) -> str:
        return self.local.data_address

    async def frame(self, rec: Intake, layer: int, parts: list[Any]) -> Any:
        return parts or None


CONNECTOR = Backend("zmq", ZmqSend, ZmqReceive, auto_rank=2)
