"""Refused before the weights load, not after: a node asks each gateway whether the cluster
would take a node of its model, numerics (dtype and quantization) and KV layout (`Probe`)
while its weights load, and leaves at once on a refusal. Loading an 8B model reads and
converts gigabytes; `Register`, after the load, would refuse such a node all the same.

The answer only saves time: a gateway that does not answer before the weights are loaded
(not up yet, a version that drops the message, a peer without the cluster key) refuses
nothing, and `Register` decides as before. Nothing is registered or kept by a `Probe`. A
refused node leaves as SIGTERM during a load would: a KV cache file it had just made in
/dev/shm is removed by the next node's start on that host (common/engine/shared_kv.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import sys
from concurrent.futures import Future
from typing import Any

import zmq

from pdserve.common.config import EngineConfig, NodeConfig
from pdserve.common.errors import EXIT_REFUSED
from pdserve.common.model.config import load_model_config, resolve_model
from pdserve.common.node.links import gateway_addresses
from pdserve.common.numerics import code_path, isa_level
from pdserve.common.wire.protocol import GATEWAY_DECODER, Probe, RegisterRefuse
from pdserve.common.wire.security import ClusterKey, close_context, make_context
from pdserve.common.wire.transport import CONTROL_MAX_MSG, decode_or_none, make_socket, send

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the load is looked at while answers are awaited


def probe_of(role: str, ecfg: EngineConfig, ncfg: NodeConfig, fingerprint: str) -> Probe:
    """What `Register` will say of the node's model, from the model's files (the weights are
    not read: the config is the GGUF's header or config.json)."""
    source = resolve_model(ecfg.model)
    return Probe(
        node_id=ncfg.node_id or f"({role}, starting)",
        model_id=source.model_id,
        dtype=ecfg.numerics,
        tokenizer_fingerprint=fingerprint,
        kv_layout=load_model_config(source).layout_fingerprint(),
        # the CPU level: a node of another is refused while it loads, not after (the kernels'
        # parts of the path are known once they are built, at the load)
        code_path=code_path(isa=isa_level(ecfg.dtype)) if ecfg.device == "cpu" else "",
    )


async def ask(
    cfg: NodeConfig, key: ClusterKey | None, probe: Probe, loading: Future[Any],
    wait: float = math.inf,
) -> str | None:  # fmt: skip
    """The first refusal of any gateway, None if none refused by the time every gateway
    answered, the weights loaded, or `wait` seconds passed."""
    try:
        addresses = gateway_addresses(cfg.gateway)
    except (ValueError, OSError):  # a malformed --gateway: the node's start says so
        return None
    ctx = make_context(key)
    pending: dict[asyncio.Future[Any], str] = {}
    try:
        for address in addresses:
            try:
                sock = make_socket(ctx, "node.control", address, max_msg=CONTROL_MAX_MSG,
                                   identity=f"probe-{secrets.token_hex(8)}")  # fmt: skip
                await send(sock, probe)
            except (zmq.ZMQError, ValueError, OSError) as exc:  # only time is at stake
                log.info("no probe to %s before the load: %s", address, exc)
                continue
            pending[asyncio.ensure_future(sock.recv())] = address
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while pending and not loading.done() and loop.time() < deadline:
            done, _ = await asyncio.wait(pending, timeout=POLL_S)
            for answered in done:
                address = pending.pop(answered)
                msg = decode_or_none(GATEWAY_DECODER, answered.result())
                if isinstance(msg, RegisterRefuse):
                    return f"the gateway at {address} refused it: {msg.reason}"
        return None
    finally:
        for waiting in pending:
            waiting.cancel()
        close_context(ctx)  # closes the sockets (linger 0)


def leave(role: str, reason: str) -> None:
    """Exit now, the weights' load left unfinished on its thread (as SIGTERM during a load
    would: a KV cache file it made in /dev/shm is swept by the next node's start)."""
    log.error("%s node refused before its weights loaded: %s", role, reason)
    print(f"pdserve {role}: error: {reason}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_REFUSED)  # not restarted by `pdserve up` (pdserve/supervisor.py)
