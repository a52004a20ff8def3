"""Optimizer state under sharding: each rank keeps only its parameters' entries; checkpoints hold all of them.

A checkpoint holds one optimizer file per shard, each written by a rank that holds it, through the crash-safe
commit (one version, committed by the first rank after all shards are in); the manifest lists the parameter indices
each file holds. Loading merges the shards back into one `optimizer.state_dict()`, so a checkpoint loads into any
number of ranks and into a single process; after a load or a compile each rank drops the entries of parameters it
does not own (resharding to the new plan). A rank that already knows what it owns (its training step is compiled)
reads only the shard files holding some of it (`owned_indices`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetc.comm import env, host
from fleetc.errors import CheckpointError
from fleetc.runtime import checkpoint_commit
from fleetc.runtime.checkpoint import TrainerState, write_checkpoint

SHARD_FILE = "optimizer.shard{:05d}.pt"


def save_sharded_checkpoint(root: str, live: TrainerState, config: Any, rng: list, shard_index: int,
                            writes_shard: bool, pieces: list[list[int]] = ()) -> str:
    """Every rank calls it. The first rank stages a new version; each rank with `writes_shard` (one replica of each
    shard) writes its own optimizer entries there as `optimizer.shard<index>.pt`; after a barrier the first rank
    writes the rest and commits (checkpoint_commit), and every rank learns the outcome (CheckpointError on all when
    any write failed; the staged version is then aborted). `pieces`: [index, lo, hi] of each parameter of which this
    rank holds only a piece of the state (`state_pieces`), recorded in the manifest."""
    staged, problem = None, None
    if env.rank() == 0:
        try:
            staged = checkpoint_commit.begin(root)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    path, problem = host.gather_objects((staged.path if staged else None, problem),
                                        "checkpoint (staging a version)")[0]
    name = SHARD_FILE.format(shard_index)
    entries = live.optimizer.state_dict()["state"]
    if problem is None and writes_shard:
        try:
            checkpoint_commit.StagedVersion(root, 0, path).write(name, entries)
        except OSError as exc:
            problem = f"rank {env.rank()} writing {name}: {type(exc).__name__}: {exc}"
    written = host.gather_objects((name if writes_shard else None, sorted(entries), list(pieces), problem),
                                  "checkpoint (writing shards)")
    problems = [p for _, _, _, p in written if p is not None]
    result = ""
    if env.rank() == 0 and staged is not None:
        if problems:
            staged.abort()
        else:
            try:
                result = write_checkpoint(staged, live, config, rng, {n: held for n, held, _, _ in written if n},
                                          {n: split for n, _, split, _ in written if n})
            except (OSError, CheckpointError) as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
    result, problems = host.gather_objects((result, problems), "checkpoint (waiting for the commit)")[0]
    if problems:
        raise CheckpointError(f"checkpoint {root!r} was not written: {problems[0]}")
    return result


def drop_foreign_state(optimizer: torch.optim.Optimizer | None, model: nn.Module, owned: set[str]) -> int:
    """Forget the state of parameters this rank does not own (their owners keep it); returns how many entries."""
    if optimizer is None:
        return 0
    foreign = [p for name, p in model.named_parameters() if name not in owned and p in optimizer.state]
    for param in foreign:
        del optimizer.state[param]
    return len(foreign)


def owned_parameters(metadata: dict[str, Any]) -> set[str] | None:
    """The parameters a compiled Program's rank owns under sharding (None: not sharded)."""
    sharding = metadata.get("sharding")
    return set(sharding["owned"]) if sharding and "owned" in sharding else None


def owned_indices(optimizer: torch.optim.Optimizer | None, model: nn.Module, owned: set[str] | None) -> set[int] | None:
    """The positions (as `optimizer.state_dict()` numbers parameters) of the parameters this rank owns; None when
    that is not known yet (no compiled training step) or there is no optimizer: then every shard is needed."""
    if optimizer is None or owned is None:
        return None
    mine = {id(p) for name, p in model.named_parameters() if name in owned}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index for index, p in enumerate(params) if id(p) in mine}


def state_pieces(metadata: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[int]]:
    """[index, lo, hi] for each parameter of which this rank keeps only a piece of the optimizer state (sharding on
    flat buckets), `index` numbered as `optimizer.state_dict()` numbers parameters."""
    bindings = metadata.get("state_bindings", {})
    named = dict(model.named_parameters())
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    ranges = {bindings[var][0]: (lo, hi) for var, (lo, hi) in metadata.get("state_pieces", {}).items()}
    return sorted([index[id(named[name])], lo, hi] for name, (lo, hi) in ranges.items())
