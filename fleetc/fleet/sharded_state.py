"""Optimizer state under sharding: each rank keeps only its parameters' entries; checkpoints hold all of them.

A checkpoint holds one optimizer file per shard, each written by a rank that holds it, through the crash-safe
commit (one version, committed by the first rank after all shards are in). Loading merges every shard back into
one `optimizer.state_dict()`, so a checkpoint loads into any number of ranks and into a single process; after a
load or a compile each rank drops the entries of parameters it does not own (resharding to the new plan).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fleetc.fleet.checkpoint_parts import save_with_parts
from fleetc.runtime.checkpoint import TrainerState, write_checkpoint

SHARD_FILE = "optimizer.shard{:05d}.pt"


def save_sharded_checkpoint(root: str, live: TrainerState, config: Any, rng: list, shard_index: int,
                            writes_shard: bool) -> str:
    """Every rank calls it. Each rank with `writes_shard` (one replica of each shard) writes its own optimizer
    entries as `optimizer.shard<index>.pt` into one staged version, which the first rank commits with the rest
    (fleet/checkpoint_parts.py: CheckpointError on every rank when any write failed)."""
    part = (SHARD_FILE.format(shard_index), live.optimizer.state_dict()["state"]) if writes_shard else None
    return save_with_parts(root, part, lambda staged, names: write_checkpoint(staged, live, config, rng, names))


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
