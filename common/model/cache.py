"""A small on-disk cache for what is slow to derive from a model file and never changes for
that file: the GGUF tokenizer takes ~2.5 s of pure-Python metadata parsing in every process
that loads it (the gateway and every node), against ~0.1 s from its serialized form.

Entries live under `$PDSERVE_CACHE_DIR` (default `$XDG_CACHE_HOME/pdserve`, else
`~/.cache/pdserve`), keyed by the file's path, size and modification time, so an edited or
replaced model file is a miss. Writes are atomic (a temporary file, then rename); a cache
that cannot be written (read-only home, full disk) is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pdserve" if xdg else Path.home() / ".cache" / "pdserve"


def key(kind: str, path: Path) -> str:
    st = path.stat()
    ident = f"{kind}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return f"{kind}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"


def read(name: str) -> str | None:
    try:
        return (cache_dir() / name).read_text()
    except OSError:
        return None


def write(name: str, text: str) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, folder / name)
    except OSError as exc:
        log.debug("not caching %s: %s", name, exc)
