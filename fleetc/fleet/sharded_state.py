"""Optimizer state under sharding: each rank keeps only its parameters' entries; checkpoints hold all of them.

A checkpoint is consolidated (every rank's entries gathered, one rank writes them as one ordinary
`optimizer.state_dict()`), so it loads into any number of ranks and into a single process; after a load
or a compile each rank drops the entries of parameters it does not own (resharding to the new plan).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from fleetc.capture.optimizer_state import shadow_optimizer
from fleetc.comm import host


def consolidated_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A view of `optimizer` holding every rank's state entries (a collective: every rank calls it)."""
    gathered = host.gather_objects(optimizer.state_dict()["state"], "checkpoint (gathering sharded optimizer state)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    merged: dict = defaultdict(dict)
    for entries in gathered:  # data-parallel replicas of an owner hold the same entries
        for index, entry in entries.items():
            merged[params[index]] = entry
    shadow = shadow_optimizer(optimizer, optimizer.param_groups[0], merged)
    shadow.param_groups = optimizer.param_groups
    return shadow


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
