"""The on-disk kernel cache shared by every backend: where it lives and how files enter it atomically.

`$FLEETC_CACHE_DIR` (default `~/.cache/fleetc`) holds one subdirectory per backend (`triton/`, `cpu/`).
Files are named after a hash of what produced them, and written to a temporary file first then renamed,
so concurrent processes never read half a file.
"""
from __future__ import annotations

import os
import pathlib
import tempfile


def cache_root() -> pathlib.Path:
    """$FLEETC_CACHE_DIR, else ~/.cache/fleetc."""
    return pathlib.Path(os.environ.get("FLEETC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fleetc"))


def write_atomic(path: pathlib.Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    with tempfile.NamedTemporaryFile(mode, dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


def temporary_path(directory: pathlib.Path, suffix: str) -> pathlib.Path:
    """A fresh file name in `directory` for a tool to write into before `os.replace` moves it into place."""
    directory.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=directory, suffix=suffix)
    os.close(handle)
    return pathlib.Path(name)
