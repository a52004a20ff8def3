"""fleetc's on-disk cache directory, shared by the kernel backends and the compile cache: where it lives, how files
enter it atomically, and when its directories are trusted.

`$FLEETC_CACHE_DIR` (default `~/.cache/fleetc`) holds one subdirectory per backend (`triton/`, `cpu/`) and the
compile cache (`compile/`, fleetc/compile_cache).
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


def private_directory(path: pathlib.Path) -> str | None:
    """Create `path` with mode 0700 if missing; why it cannot be trusted (another user owns it, or others may
    write into it), or None when it is this user's own. Entries in an untrusted directory are never read."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"{path} is owned by user id {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & 0o022:
        return f"{path} is writable by other users (mode {info.st_mode & 0o777:o}; fleetc creates it 0700)"
    return None
