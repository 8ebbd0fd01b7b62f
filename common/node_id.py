"""What a node may be called. Its id opens each tcp and UCX KV stream in a fixed 64-byte field
(space padded), is its ZeroMQ routing id and names its files in /dev/shm and the disk cache
(pdserve-seg-ID-...): at most 64 ASCII letters, digits, '.', '_' or '-', a letter or digit
first. A longer id was cut on the stream and matched no KV header of its own (every frame
discarded, every transfer timed out); two sharing their first 64 bytes shut each other's
streams."""

from __future__ import annotations

import hashlib
import re
from typing import Annotated

import msgspec

ID_BYTES = 64
# a node id as messages carry it: any that ZeroMQ could route by (at most 255 bytes) decodes,
# what a node may call itself is `id_problem`'s; unbounded, a 64 MB one was logged whole and
# echoed back in the refusal
WireNodeId = Annotated[str, msgspec.Meta(max_length=255)]
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # ASCII: a str pattern without re.UNICODE
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def id_problem(node_id: str) -> str | None:
    """Why `node_id` cannot name a node (None: it can)."""
    if _ID.fullmatch(node_id):
        return None
    return (
        f"a node id is 1 to {ID_BYTES} ASCII letters, digits, '.', '_' or '-', beginning "
        "with a letter or digit (no spaces)"
    )


def default_id(role: str, host: str, pid: int) -> str:
    """ROLE-HOST-PID, the host name made safe and, where it is too long, cut and marked with
    a hash of the whole (two long names of one prefix stay apart)."""
    host, tail = _UNSAFE.sub("-", host), f"-{pid}"
    room = ID_BYTES - len(role) - 1 - len(tail)
    if len(host) > room:
        host = host[: room - 9] + "-" + hashlib.sha256(host.encode()).hexdigest()[:8]
    return f"{role}-{host}{tail}"
