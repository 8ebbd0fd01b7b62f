"""The connection a stream is written to. A client that vanished without a FIN (its host or
network gone) leaves writes waiting for TCP to give up, many minutes; a chunk it has not
taken within `--send-timeout` ends the connection instead (nginx's `send_timeout`). A
resumable stream's connection can also be hung up from outside: its client resumes the
stream elsewhere, so this connection is dead to it (docs/architecture.md, "Several
gateways"). Either way the handler is cancelled, as when the client closes, and its
`finally` frees the request or lets a resumable one go for the resume."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from aiohttp import web

log = logging.getLogger("pdserve.gateway.core")


class Connection:
    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout: float) -> None:
        self.request, self.resp, self.timeout = request, resp, timeout
        self.task = asyncio.current_task()  # the handler

    async def write(self, data: bytes) -> None:
        await self._sent(self.resp.write(data))

    async def end(self) -> None:
        await self._sent(self.resp.write_eof())

    async def _sent(self, io: Awaitable[None]) -> None:
        try:
            await asyncio.wait_for(io, self.timeout)
        except (asyncio.TimeoutError, ConnectionResetError) as exc:  # 3.10: not TimeoutError
            if isinstance(exc, asyncio.TimeoutError):
                log.info("client at %s took nothing for %g s: gone", self.request.remote,
                         self.timeout)  # fmt: skip
            # a client that leaves is no error: the handler ends as when aiohttp sees it go
            self.hangup()
            await asyncio.sleep(0)  # the cancellation lands here
            raise

    def hangup(self) -> None:
        """End the connection and its handler, whatever the handler waits for."""
        if self.request.transport is not None:
            self.request.transport.abort()
        if self.task is not None:
            self.task.cancel()
