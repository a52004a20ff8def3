"""Checkpoints several ranks write: each writer puts its own part file into one staged version; one commit.

The first rank stages a new version (`checkpoint_commit.begin`); every rank that has a part writes it into the
staging directory (a rank may write several, e.g. a sharded pipeline stage's part and its optimizer shard);
after a barrier (every rank's outcome gathered) the first rank writes the common files and
commits the version (`checkpoint_commit`); every rank learns the outcome, so a failed write is a CheckpointError
on all of them, never a hang, and the staged version is aborted. Sharding (one optimizer file per shard) and the
pipeline (one file per pipeline rank) both save through here, and so do both at once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fleetc.comm import env, host
from fleetc.errors import CheckpointError
from fleetc.runtime import checkpoint_commit


def save_with_parts(root: str, parts: Sequence[tuple[str, Any, Any]],
                    commit: Callable[[checkpoint_commit.StagedVersion, dict[str, Any]], str]) -> str:
    """Every rank calls it. `parts`: (file name, value, about) of each file this rank writes (none: an empty
    sequence), `about` being what the manifest should say of it (plain data). `commit(staged, written)` runs on the
    first rank once every part is in (`written`: part file → its `about`, in file order): it writes the common files
    and commits, returning the version's directory, which every rank gets back."""
    staged, problem = None, None
    if env.rank() == 0:
        try:
            staged = checkpoint_commit.begin(root)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    path, problem = host.gather_objects((staged.path if staged else None, problem),
                                        "checkpoint (staging a version)")[0]
    for name, value, _ in parts if problem is None else ():
        try:
            checkpoint_commit.StagedVersion(root, 0, path).write(name, value)
        except OSError as exc:
            problem = f"rank {env.rank()} writing {name}: {type(exc).__name__}: {exc}"
            break
    written = host.gather_objects(([(name, about) for name, _, about in parts], problem),
                                  "checkpoint (writing each rank's parts)")
    problems = [p for _, p in written if p is not None]
    result = ""
    if env.rank() == 0 and staged is not None:
        if problems:
            staged.abort()
        else:
            try:
                result = commit(staged, dict(sorted(item for files, _ in written for item in files)))
            except (OSError, CheckpointError) as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
    result, problems = host.gather_objects((result, problems), "checkpoint (waiting for the commit)")[0]
    if problems:
        raise CheckpointError(f"checkpoint {root!r} was not written: {problems[0]}")
    return result
