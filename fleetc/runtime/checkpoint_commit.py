"""Crash-safe checkpoint directories: every save is a new version, published by atomically swapping a pointer.

Layout of a checkpoint directory `ckpt/`:

    ckpt/LATEST              the name of the current version ("v000003"), replaced atomically
    ckpt/v000003/            a complete version: its files and MANIFEST.json (size and sha256 of each file)
    ckpt/v000002/            the previous version, kept until the next commit
    ckpt/.staging-v000004-…  a save in progress (or killed); removed by the next save

A save writes and fsyncs every file into a staging directory (any rank may write into it), then one writer
commits: the manifest, fsync, rename to `vNNNNNN`, fsync the checkpoint directory, write and rename LATEST,
fsync again, prune. A writer killed at any point leaves LATEST naming a complete version. Loading reads LATEST,
checks each file against the manifest, and unpickles it with `weights_only=True` (files from others never run
code). Every writer of checkpoints (single process, data parallel, later sharding) goes through this module.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetc.errors import CheckpointError

FORMAT_VERSION = 1
POINTER = "LATEST"
MANIFEST = "MANIFEST.json"
KEEP_VERSIONS = 2  # the current version and the one before it
_VERSION = re.compile(r"^v(\d{6})$")
_STAGING_PREFIX = ".staging-"

# Tests set this to a callable that kills the writer at a named point (see `commit_points`).
fault_hook: Callable[[str], None] | None = None


def _fault_point(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def commit_points(files: Iterable[str]) -> list[str]:
    """Every point of a save where a writer may die, in order (for fault-injection tests)."""
    points = ["staging created"]
    for name in files:
        points += [f"writing {name}", f"wrote {name}"]
    return points + [f"wrote {MANIFEST}", "renamed the version", f"wrote {POINTER}.tmp", f"swapped {POINTER}",
                     "pruned"]


def _fsync_dir(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _versions(root: str) -> list[int]:
    found = [_VERSION.match(name) for name in os.listdir(root)] if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in found if m)


def _version_name(version: int) -> str:
    return f"v{version:06d}"


def _read_pointer(root: str) -> str | None:
    path = os.path.join(root, POINTER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="ascii") as handle:
            name = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not _VERSION.match(name) or not os.path.isdir(os.path.join(root, name)):
        raise CheckpointError(f"{path}: names {name[:40]!r}, which is not a version directory of {root}")
    return name


class _HashingWriter(io.RawIOBase):
    """A binary file that hashes what is written to it (torch.save writes through it)."""

    def __init__(self, path: str, name: str):
        self.handle = open(path, "xb")
        self.name = name
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.handle.write(view)
        self.sha256.update(view)
        if self.size == 0:
            _fault_point(f"writing {self.name}")  # a writer killed here leaves a truncated file
        self.size += written
        return written

    def close(self) -> None:
        if not self.handle.closed:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
        super().close()


@dataclass
class StagedVersion:
    """A version being written: put files into `path` with `write`, then `commit` (or `abort`)."""

    root: str
    version: int
    path: str
    files: dict[str, dict] = field(default_factory=dict)  # name → {"bytes", "sha256"} of files written here

    def write(self, name: str, value: Any) -> None:
        """torch.save `value` as `name` in the staging directory, fsynced and hashed."""
        with _HashingWriter(os.path.join(self.path, name), name) as handle:
            torch.save(value, handle)
        self.files[name] = {"bytes": handle.size, "sha256": handle.sha256.hexdigest()}
        _fault_point(f"wrote {name}")

    def commit(self, meta: dict[str, Any]) -> str:
        """Publish the version (files written here, and any other file put into `path` by another writer);
        returns its directory. `meta` (JSON data) is kept in the manifest for validation at load time."""
        for name in sorted(os.listdir(self.path)):
            if name not in self.files and name != MANIFEST:
                self.files[name] = _digest(os.path.join(self.path, name))
        manifest = {"fleetc_checkpoint": FORMAT_VERSION, "version": self.version, "files": self.files, "meta": meta}
        with _HashingWriter(os.path.join(self.path, MANIFEST), MANIFEST) as handle:
            handle.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fault_point(f"wrote {MANIFEST}")
        _fsync_dir(self.path)
        final = os.path.join(self.root, _version_name(self.version))
        os.rename(self.path, final)
        _fsync_dir(self.root)
        _fault_point("renamed the version")
        pointer = os.path.join(self.root, POINTER)
        with open(pointer + ".tmp", "w", encoding="ascii") as handle:
            handle.write(_version_name(self.version) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        _fault_point(f"wrote {POINTER}.tmp")
        os.replace(pointer + ".tmp", pointer)
        _fsync_dir(self.root)
        _fault_point(f"swapped {POINTER}")
        for old in _versions(self.root)[:-KEEP_VERSIONS]:
            shutil.rmtree(os.path.join(self.root, _version_name(old)), ignore_errors=True)
        _fault_point("pruned")
        return final

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _digest(path: str) -> dict:
    sha256 = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha256.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": sha256.hexdigest()}


def _clean_stale(root: str) -> None:
    """Remove what killed saves left: staging directories, a pointer temporary, versions LATEST never named."""
    current = _read_pointer(root)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(_STAGING_PREFIX) or name == POINTER + ".tmp":
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        elif _VERSION.match(name) and current is not None and name > current:
            shutil.rmtree(path, ignore_errors=True)


def begin(root: str | os.PathLike) -> StagedVersion:
    """Start a new version of the checkpoint at `root` (created if missing), after cleaning up killed saves."""
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    _clean_stale(root)
    version = max(_versions(root), default=0) + 1
    path = os.path.join(root, f"{_STAGING_PREFIX}{_version_name(version)}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(path)
    _fault_point("staging created")
    return StagedVersion(root, version, path)


@dataclass
class CheckpointVersion:
    """One complete version, opened for reading: `read(name)` checks a file against the manifest and loads it."""

    path: str
    manifest: dict | None  # None: a checkpoint written before versioning (plain files, nothing to check against)

    @property
    def meta(self) -> dict:
        return (self.manifest or {}).get("meta", {})

    def read(self, name: str) -> Any:
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if self.manifest is not None:
            expected = self.manifest["files"].get(name)
            if expected is None:
                raise CheckpointError(f"{path}: not listed in {MANIFEST}")
            if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                raise CheckpointError(f"{path}: {len(data)} bytes whose sha256 differs from {MANIFEST} "
                                      f"({expected['bytes']} bytes): the file is truncated or corrupted")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many types (EOFError, UnpicklingError, RuntimeError, …)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise CheckpointError(f"{path}: not a loadable torch file ({type(exc).__name__}: {first}); "
                                  "fleetc loads with weights_only=True, so pickled code is refused") from None


def _valid_manifest(manifest: Any, files: Iterable[str]) -> bool:
    if not (isinstance(manifest, dict) and manifest.get("fleetc_checkpoint") == FORMAT_VERSION
            and isinstance(manifest.get("files"), dict) and isinstance(manifest.get("meta", {}), dict)):
        return False
    entries = manifest["files"]
    return set(files) <= set(entries) and all(
        isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", e["sha256"]) for e in entries.values())


def open_latest(root: str | os.PathLike, files: Iterable[str]) -> CheckpointVersion:
    """The version LATEST names; `root` may also be a version directory or a checkpoint from before versioning."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: no such checkpoint directory")
    name = _read_pointer(root)
    path = os.path.join(root, name) if name is not None else root
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.exists(manifest_path):
        try:
            with open(manifest_path, encoding="utf-8") as handle:
                manifest = json.load(handle)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{manifest_path}: unreadable ({exc})") from None
        if not _valid_manifest(manifest, files):
            raise CheckpointError(f"{manifest_path}: not a fleetc checkpoint manifest of format {FORMAT_VERSION} "
                                  f"listing {sorted(files)} (damaged?)")
        return CheckpointVersion(path, manifest)
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"{root}: not a fleetc checkpoint (no {POINTER}, no {MANIFEST}, missing {missing})")
    return CheckpointVersion(path, None)
