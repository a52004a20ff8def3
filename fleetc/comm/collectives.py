"""Gradient allreduce ops (role collective): one flat buffer per bucket, issued async, waited on with a timeout.

A bucket's flat buffer is allocated by the Program (`aten.empty`); gradients whose producers write
straight into their slot of it are marked in place (see passes/allreduce_views.py), the others are
copied into their slot by `fleetc.c_allreduce_start`, which then issues the averaging allreduce on
the buffer. `fleetc.c_allreduce_wait` waits for it and returns the averaged gradients as views of
the buffer (no copy back); `fleetc.c_allreduce_wait_into` copies them back into the persistables
the buffer was filled from (gradient merge's accumulators, allreduced once per k steps). A
synchronous allreduce is a start directly followed by its wait. The hierarchical algorithm reduces
to each node's first rank, allreduces across nodes, then broadcasts inside the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetc.comm import groups
from fleetc.comm.env import collective_timeout
from fleetc.comm.faults import collective_failed
from fleetc.ir.registry import register_op

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


def fill_bucket(flat: torch.Tensor, grads: list, in_place: list, label: str) -> None:
    """Copy the gradients not written in place into their slots of `flat`; check the others are in their slots.

    An in-place gradient outside its slot would leave garbage in the buffer, so it is an error, never a copy.
    """
    offset = 0
    for index, (grad, written) in enumerate(zip(grads, in_place)):
        numel = grad.numel()
        if not written:
            flat[offset:offset + numel].view(grad.shape).copy_(grad)
        elif grad.data_ptr() != flat.data_ptr() + offset * flat.element_size() or not grad.is_contiguous():
            raise RuntimeError(f"{label}: gradient {index} of the bucket was to be written into its slot at element "
                               f"{offset} of the bucket buffer but lives elsewhere")
        offset += numel


def bucket_views(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Views of consecutive slots of `flat`, one per shape."""
    views, offset = [], 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        views.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return views


@register_op("c_allreduce_start", "copy the gradients not written in place into the bucket buffer and issue its "
             "averaging allreduce (async)")
def c_allreduce_start(flat: torch.Tensor, grads: list, in_place: list, group: str, algorithm: str,
                      label: str) -> PendingAllreduce:
    label = f"gradient allreduce {label!r}"
    fill_bucket(flat, grads, in_place, label)
    if algorithm == HIERARCHICAL:
        intra = f"intra:{group}"
        root = groups.group_ranks(intra)[0]
        work = run_collective(label, dist.reduce, flat, root, op=dist.ReduceOp.SUM, group=groups.group(intra),
                              async_op=True)
    else:
        work = run_collective(label, dist.all_reduce, flat, op=dist.ReduceOp.AVG, group=groups.group(f"dp:{group}"),
                              async_op=True)
    return PendingAllreduce(work, label, algorithm, group)


@register_op("c_allreduce_wait", "wait for a bucket's allreduce; the averaged gradients are views of its buffer")
def c_allreduce_wait(flat: torch.Tensor, pending: PendingAllreduce, shapes: list) -> torch.Tensor | tuple:
    finish_allreduce(flat, pending)
    views = bucket_views(flat, shapes)
    return views[0] if len(views) == 1 else tuple(views)


@register_op("c_allreduce_wait_into", "wait for a bucket's allreduce and copy the averages back into the persistables "
             "it was filled from, in place (gradient merge's accumulators)")
def c_allreduce_wait_into(flat: torch.Tensor, pending: PendingAllreduce, targets: list) -> None:
    finish_allreduce(flat, pending)
    for target, view in zip(targets, bucket_views(flat, [t.shape for t in targets])):
        target.copy_(view)


def finish_allreduce(flat: torch.Tensor, pending: PendingAllreduce) -> None:
    """Wait for an issued bucket allreduce; after it `flat` holds the average over all ranks."""
    wait_collective(pending.label, pending.work)
    if pending.algorithm == HIERARCHICAL:
        intra, inter = f"intra:{pending.group}", f"inter:{pending.group}"
        root = groups.group_ranks(intra)[0]
        if dist.get_rank() == root:
            blocking_collective(pending.label, dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=groups.group(inter))
        blocking_collective(pending.label, dist.broadcast, flat, root, group=groups.group(intra))
        flat.div_(dist.get_world_size())
