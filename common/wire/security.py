"""Authenticated internal traffic (`--cluster-key FILE`, env PDSERVE_CLUSTER_KEY).

One key pair, made by `pdserve keygen FILE`, is shared by every process of a cluster (a
Kubernetes or compose secret). With it:

- every ZeroMQ socket uses CurveZMQ (encrypted, authenticated): the binding side is the
  CURVE server and admits only clients that prove they hold the cluster's secret key (a ZAP
  handler checks the client's public key); the connecting side authenticates the server by
  the same public key. A process without the key cannot register as a node, push tokens,
  or send or receive KV and prefix fetches over ZeroMQ;
- the tcp KV stream answers a challenge at connect: the decode node sends a random nonce, the
  prefill node returns HMAC-SHA256(secret, nonce + its node id), checked in constant time;
- refused peers are logged (rate-limited) with the reason and address.

Without a key nothing changes (loopback, single host). The shm backend needs none (the same
host and IPC namespace). UCX traffic is not authenticated: with a key, use tcp or zmq
between hosts (the node logs a warning if ucx is forced).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)
NONCE_BYTES = 32
ZAP_DOMAIN = "pdserve"
MAC_BYTES = 32


class BadKey(ValueError):
    """A key file that cannot be read or is malformed."""


@dataclass(frozen=True)
class ClusterKey:
    public: bytes  # Z85, 40 bytes
    secret: bytes  # Z85, 40 bytes

    @classmethod
    def generate(cls) -> ClusterKey:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | Path) -> ClusterKey:
        """`public = ...` and `secret = ...` lines (Z85), as `save` writes them."""
        try:
            lines = [line.split("=", 1) for line in Path(path).read_text().splitlines()]
            fields = {name.strip(): value for name, *rest in lines if rest for value in rest}
            key = cls(fields["public"].strip().encode(), fields["secret"].strip().encode())
        except (OSError, KeyError, ValueError) as exc:
            hint = ""
            if isinstance(exc, PermissionError):  # a compose secret keeps the host's mode
                hint = f" (uid {os.getuid()} cannot read it: chgrp/chmod it, docs/guide.md)"
            # the kind and the OS's reason, never the exception's text: a UnicodeDecodeError
            # (the flag naming another file) carries the file's bytes, the secret among them
            why = type(exc).__name__ + (f": {exc.strerror}" if isinstance(exc, OSError) else "")
            raise BadKey(f"cannot read the cluster key {path}: {why}{hint}") from None
        if len(key.public) != 40 or len(key.secret) != 40:
            raise BadKey(f"{path}: public and secret must be 40 Z85 characters each")
        try:
            derived = zmq.curve_public(key.secret)
        except zmq.ZMQError as exc:  # 40 characters, not all of them Z85
            raise BadKey(f"{path}: the secret key is not Z85 ({exc})") from exc
        if derived != key.public:
            raise BadKey(f"{path}: the public key does not belong to the secret key")
        return key

    def save(self, path: str | Path) -> None:
        # 0600 even over an existing file (the mode is only applied to a new one), and never
        # through a symlink (its target overwritten with the secret)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# pdserve cluster key: keep secret (every node and the gateway use it)\n")
            f.write(f"public = {self.public.decode()}\nsecret = {self.secret.decode()}\n")

    def mac(self, *parts: bytes) -> bytes:
        return hmac.new(zmq.utils.z85.decode(self.secret), b"".join(parts), hashlib.sha256).digest()

    def check(self, tag: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(tag, self.mac(*parts))


class Refusals:
    """Counts refused peers by kind (`handshake`: a ZeroMQ peer without the key or with
    another; `other-key`: one with another key, also counted as a failed handshake;
    `kv-stream`: a tcp KV connection failing the challenge) and logs them, at most one line
    per reason every 10 s (a scanner must not flood the log)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.counts: dict[str, int] = {"handshake": 0, "other-key": 0, "kv-stream": 0}

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def refuse(self, kind: str, reason: str, *args: object) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.last.get(reason, -1e9) >= 10.0:
            self.last[reason] = now
            log.warning("refused an unauthenticated peer: " + reason, *args)


REFUSALS = Refusals()


class _OnlyClusterKey:
    """ZAP credentials: a CURVE client is admitted only with the cluster's public key."""

    def __init__(self, key: ClusterKey) -> None:
        self.public = key.public

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = hmac.compare_digest(client_key, self.public)  # both Z85
        if not ok:
            REFUSALS.refuse("other-key", "a ZeroMQ client with another CURVE key")
        return ok


_KEYS: weakref.WeakKeyDictionary[zmq.asyncio.Context, tuple[ClusterKey, ThreadAuthenticator]]
_KEYS = weakref.WeakKeyDictionary()


def make_context(key: ClusterKey | None) -> zmq.asyncio.Context:
    """A context whose sockets (made by common/wire/transport.py) use CurveZMQ with `key`."""
    ctx = zmq.asyncio.Context()
    if key is not None:
        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=log)
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OnlyClusterKey(key))
        _KEYS[ctx] = (key, auth)
    return ctx


def close_context(ctx: zmq.asyncio.Context) -> None:
    entry = _KEYS.pop(ctx, None)
    if entry is not None:
        entry[1].stop()
    ctx.destroy(linger=0)


def key_of(ctx: zmq.asyncio.Context) -> ClusterKey | None:
    entry = _KEYS.get(ctx)
    return entry[0] if entry else None


def secure_socket(sock: zmq.Socket, key: ClusterKey, server: bool) -> None:
    """CURVE on one socket; must run before it binds or connects."""
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    if server:
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
    else:
        sock.curve_serverkey = key.public


async def watch_handshakes(sock: zmq.asyncio.Socket, name: str) -> None:
    """Log peers whose handshake failed on a CURVE server socket: a client without the key
    (plain ZeroMQ, or another key) never reaches the application, so this is where it shows."""
    events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH
    monitor = sock.get_monitor_socket(events)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            where, code = event["endpoint"], event["value"]
            REFUSALS.refuse("handshake", "handshake failed on %s %s (%s)", name, where, code)
    finally:
        with contextlib.suppress(zmq.ZMQError):  # the socket may be closed already
            sock.disable_monitor()
        monitor.close(linger=0)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)
