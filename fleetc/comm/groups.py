"""Named communicator groups a Program's collective ops refer to, created in one fixed order on every rank.

A Program names groups (`dp:0`, `intra:1`, …) and lists how each partitions the world in
`metadata["collective_groups"]`; the runtime creates them here before the first step, so ops
carry a name, never a live object, and Programs stay printable and serializable.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fleetc.comm.env import collective_timeout
from fleetc.errors import CollectiveError

_GROUPS: dict[tuple, Any] = {}
_BY_NAME: dict[str, tuple] = {}


def group_partitions(world_size: int, comm_num: int, ranks_per_node: int, hierarchical: bool) -> dict[str, list]:
    """Group name → list of rank lists (a partition of the world; every rank belongs to one list per name)."""
    everyone = [list(range(world_size))]
    groups: dict[str, list] = {}
    for comm in range(comm_num):
        if hierarchical:
            nodes = [list(range(start, start + ranks_per_node)) for start in range(0, world_size, ranks_per_node)]
            groups[f"intra:{comm}"] = nodes
            groups[f"inter:{comm}"] = [[node[i] for node in nodes] for i in range(ranks_per_node)]
        else:
            groups[f"dp:{comm}"] = everyone
    return groups


def ensure_groups(partitions: dict[str, list]) -> None:
    """Create the process groups of `partitions` (a collective over all ranks: call it in the same order everywhere)."""
    me = dist.get_rank()
    for name, lists in partitions.items():
        for ranks in lists:
            key = (name, tuple(ranks))
            if key not in _GROUPS:
                # Every rank must call new_group for every group, members or not (torch requires it).
                _GROUPS[key] = dist.new_group(ranks, timeout=collective_timeout(), use_local_synchronization=False)
            if me in ranks:
                _BY_NAME[name] = key


def group(name: str) -> Any:
    """The process group behind a name in this process (the one that contains this rank)."""
    if name not in _BY_NAME:
        raise CollectiveError(f"communicator group {name!r} was not created; created: {sorted(_BY_NAME)}")
    return _GROUPS[_BY_NAME[name]]


def group_ranks(name: str) -> tuple[int, ...]:
    """Global ranks of this process's group called `name`."""
    group(name)
    return _BY_NAME[name][1]


def reset() -> None:
    """Forget every group (after the default process group is destroyed)."""
    _GROUPS.clear()
    _BY_NAME.clear()
