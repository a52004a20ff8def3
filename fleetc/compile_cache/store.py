"""The compile cache's files: one JSON entry per key under `$FLEETC_CACHE_DIR/compile/`, read without running code.

An entry is `{"fleetc_compile_cache": 1, "kind": ..., "key": ..., "payload": {...}}`, parsed with `json` only (the
payload's Programs and guard records go through their own restricted decoders). A missing entry is a plain miss;
an unreadable, truncated, foreign-owned or mismatched one is ignored with a CompileCacheWarning and overwritten by
the next store, and an untrusted directory (another user's, or writable by others) disables the cache with a
warning. Writes are atomic (temporary file + rename) and have one writer per key: a writer first creates
`<key>.lock` exclusively, and any other process (another rank) that finds it skips its own write.
"""
from __future__ import annotations

import json
import os
import pathlib
import time
import warnings
from typing import Any

from fleetc.codegen.cache import cache_root, private_directory, write_atomic

ENTRY_VERSION = 1
_VERSION_KEY = "fleetc_compile_cache"
STALE_LOCK_SECONDS = 600.0  # a lock this old was left by a writer that died


class CompileCacheWarning(UserWarning):
    """A compile cache entry or directory was ignored (corrupt, foreign, untrusted); the compile went on without it."""


class EntryStore:
    """Entries of the compile cache by (kind, key); `directory` defaults to `$FLEETC_CACHE_DIR/compile`."""

    def __init__(self, directory: pathlib.Path | None = None):
        self.directory = directory if directory is not None else cache_root() / "compile"
        self._untrusted: str | None = None
        self._checked = False

    def _usable(self) -> bool:
        if not self._checked:
            self._checked = True
            try:
                self._untrusted = private_directory(self.directory)
            except OSError as exc:
                self._untrusted = f"cannot create {self.directory}: {exc}"
            if self._untrusted:
                warnings.warn(f"fleetc compile cache disabled: {self._untrusted}", CompileCacheWarning, stacklevel=4)
        return self._untrusted is None

    def path(self, kind: str, key: str) -> pathlib.Path:
        return self.directory / f"{kind}-{key}.json"

    def load(self, kind: str, key: str) -> dict[str, Any] | None:
        """The payload stored under (kind, key), or None (a miss; a warning when an entry was there but unusable)."""
        if not self._usable():
            return None
        path = self.path(kind, key)
        try:
            owner = path.stat().st_uid
            if owner != os.getuid():
                return _ignored(path, f"owned by user id {owner}, not this user")
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _ignored(path, f"unreadable ({type(exc).__name__}: {exc})")
        if not isinstance(data, dict) or data.get(_VERSION_KEY) != ENTRY_VERSION:
            return _ignored(path, f"not a version {ENTRY_VERSION} fleetc compile cache entry")
        if data.get("kind") != kind or data.get("key") != key or not isinstance(data.get("payload"), dict):
            return _ignored(path, "its kind or key does not match its file name")
        return data["payload"]

    def store(self, kind: str, key: str, payload: dict[str, Any]) -> bool:
        """Write the entry atomically unless another writer holds its lock; whether this process wrote it."""
        if not self._usable():
            return False
        path = self.path(kind, key)
        lock = path.with_suffix(".lock")
        if not _take_lock(lock):
            return False
        try:
            text = json.dumps({_VERSION_KEY: ENTRY_VERSION, "kind": kind, "key": key, "payload": payload},
                              allow_nan=False)
            write_atomic(path, text)
        finally:
            lock.unlink(missing_ok=True)
        return True


def _ignored(path: pathlib.Path, why: str) -> None:
    warnings.warn(f"fleetc compile cache: ignoring {path}: {why}", CompileCacheWarning, stacklevel=4)


def _take_lock(lock: pathlib.Path) -> bool:
    """Create `lock` exclusively (replacing one older than STALE_LOCK_SECONDS); whether this process holds it."""
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < STALE_LOCK_SECONDS:
                    return False
                lock.unlink()
            except FileNotFoundError:
                pass  # its writer just finished: try once more
    return False
