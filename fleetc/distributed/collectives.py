"""Gradient allreduce ops (role collective): one flat buffer per bucket, issued async, waited on with a timeout.

`fleetc.c_allreduce_start` packs a bucket's gradients into one flat buffer (one copy) and issues
the averaging allreduce; `fleetc.c_allreduce_wait` waits for it and returns the averaged gradients
as views of the flat buffer (no copy back). A synchronous allreduce is a start directly followed
by its wait. The hierarchical algorithm reduces to each node's first rank, allreduces across
nodes, then broadcasts inside the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetc.distributed import groups
from fleetc.distributed.env import collective_timeout
from fleetc.distributed.faults import collective_failed
from fleetc.ops.registry import register_op

FLAT = "flat"
HIERARCHICAL = "hierarchical"


@dataclass
class PendingAllreduce:
    """An issued allreduce: the work handle, and what is left to do after it (hierarchical steps)."""

    work: Any
    label: str
    algorithm: str
    group: str


def run_collective(label: str, fn, *args, **kwargs) -> Any:
    """Issue a torch.distributed call; a failure becomes a CollectiveError naming `label` and the missing ranks."""
    timeout = collective_timeout()
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise collective_failed(label, exc, timeout.total_seconds()) from exc


def wait_collective(label: str, work: Any) -> None:
    """Wait for issued work, at most the collective timeout."""
    timeout = collective_timeout()
    try:
        work.wait(timeout)
    except RuntimeError as exc:
        raise collective_failed(label, exc, timeout.total_seconds()) from exc


def blocking_collective(label: str, fn, *args, **kwargs) -> None:
    """Issue a torch.distributed call and wait for it, at most the collective timeout."""
    wait_collective(label, run_collective(label, fn, *args, async_op=True, **kwargs))


@register_op("c_allreduce_start", "pack gradients into one flat buffer and issue its averaging allreduce (async)")
def c_allreduce_start(grads: list, group: str, algorithm: str, label: str) -> tuple[torch.Tensor, PendingAllreduce]:
    # Always a fresh buffer: a gradient may share storage with values backward still reads.
    flat = torch.cat([g.reshape(-1) for g in grads])
    label = f"gradient allreduce {label!r}"
    if algorithm == HIERARCHICAL:
        intra = f"intra:{group}"
        root = groups.group_ranks(intra)[0]
        work = run_collective(label, dist.reduce, flat, root, op=dist.ReduceOp.SUM, group=groups.group(intra),
                              async_op=True)
    else:
        work = run_collective(label, dist.all_reduce, flat, op=dist.ReduceOp.AVG, group=groups.group(f"dp:{group}"),
                              async_op=True)
    return flat, PendingAllreduce(work, label, algorithm, group)


@register_op("c_allreduce_wait", "wait for a bucket's allreduce; the averaged gradients are views of its buffer")
def c_allreduce_wait(flat: torch.Tensor, pending: PendingAllreduce, shapes: list) -> torch.Tensor | tuple:
    wait_collective(pending.label, pending.work)
    if pending.algorithm == HIERARCHICAL:
        intra, inter = f"intra:{pending.group}", f"inter:{pending.group}"
        root = groups.group_ranks(intra)[0]
        if dist.get_rank() == root:
            blocking_collective(pending.label, dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=groups.group(inter))
        blocking_collective(pending.label, dist.broadcast, flat, root, group=groups.group(intra))
        flat.div_(dist.get_world_size())
    views, offset = [], 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        views.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return views[0] if len(views) == 1 else tuple(views)
