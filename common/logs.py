"""Logging for every pdserve process: text for people, JSON lines for log collectors.

`--log-format json` (PDSERVE_LOG_FORMAT=json, the container default) writes one JSON object
per record. Both name the level and the process (`gateway:PORT`, a node id). A record
may carry structured fields (`extra={"fields": {...}}`, as the gateway's per-request
timeline does): JSON output merges them into the object, text output appends them as JSON
after the message, so both stay greppable by request id.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import orjson


class JsonFormatter(logging.Formatter):
    def __init__(self, label: str = "") -> None:
        super().__init__()
        self.label = label

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.label:
            out["process"] = self.label
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self, label: str = "") -> None:
        where = f"[{label.replace('%', '%%')}] " if label else ""  # a format string
        super().__init__(f"%(asctime)s %(levelname)s {where}%(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + orjson.dumps(fields, default=str).decode()
        return text


def setup_logging(level: str, fmt: str, label: str = "") -> None:
    """`label` names the process in every line (`pdserve up` interleaves its children's
    output: the node id, or `gateway:PORT`)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(label) if fmt == "json" else TextFormatter(label))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Every:
    """Says when a warning is due: at most once per `seconds` (a flood of garbage on a
    socket must not flood the log too, nor hold its loop formatting lines)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = -math.inf

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


def cut(text: str, most: int = 64) -> str:
    """A peer's string as a log line shows it: its first `most` characters, marked if cut
    (a node id of 64 MB made a log line of as much)."""
    return text if len(text) <= most else f"{text[:most]}...({len(text)} chars)"
