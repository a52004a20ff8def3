"""Host-side steps every rank takes together (a barrier, gathering small Python objects), bounded by the timeout."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fleetc.comm.env import collective_timeout, world_size
from fleetc.comm.faults import collective_failed


def barrier(label: str) -> None:
    """Every rank waits here for the others; CollectiveError naming `label` and the missing ranks on timeout."""
    if world_size() == 1:
        return
    timeout = collective_timeout()
    try:
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        raise collective_failed(label, exc, timeout.total_seconds()) from exc


def gather_objects(value: Any, label: str) -> list[Any]:
    """`value` of every rank, by rank (on every rank); a one-element list in a single process."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    try:
        dist.all_gather_object(gathered, value)
    except RuntimeError as exc:
        raise collective_failed(label, exc, collective_timeout().total_seconds()) from exc
    return gathered
