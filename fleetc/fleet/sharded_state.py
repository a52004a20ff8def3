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

from fleetc.fleet.checkpoint_parts import save_with_parts
from fleetc.runtime.checkpoint import TrainerState, write_checkpoint

SHARD_FILE = "optimizer.shard{:05d}.pt"


def save_sharded_checkpoint(root: str, live: TrainerState, config: Any, rng: list, shard_index: int,
                            writes_shard: bool, pieces: list[list[int]] = ()) -> str:
    """Every rank calls it. Each rank with `writes_shard` (one replica of each shard) writes its own optimizer
    entries as `optimizer.shard<index>.pt` into one staged version, which the first rank commits with the rest
    (fleet/checkpoint_parts.py: CheckpointError on every rank when any write failed). The manifest records the
    parameter indices each file holds and `pieces`: [index, lo, hi] of each parameter of which this rank holds only
    a piece of the state (`state_pieces`)."""
    entries = live.optimizer.state_dict()["state"]
    about = (sorted(entries), list(pieces))
    parts = [(SHARD_FILE.format(shard_index), entries, about)] if writes_shard else []

    def commit(staged: Any, written: dict[str, Any]) -> str:
        return write_checkpoint(staged, live, config, rng, {n: held for n, (held, _) in written.items()},
                                {n: split for n, (_, split) in written.items()})
    return save_with_parts(root, parts, commit)


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
