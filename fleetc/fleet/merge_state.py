"""Gradient-merge accumulators in a data-parallel checkpoint: their average over the ranks.

Mid period each rank's accumulators hold the sum of its own local gradients, and the update averages them over the
ranks (an allreduce, or a reduce-scatter under sharding: linear in them). The first rank writes the checkpoint, so
it stores that average: every rank resumes with it, adds its own gradients for the rest of the period, and the
averaged update is the uninterrupted run's (up to rounding). So does a different number of ranks, or one process
training on the whole batch. Saving the first rank's own sums dropped every other rank's gradients of the period.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fleetc.comm.collectives import blocking_collective
from fleetc.ir.program import Program, VarKind


def averaged_accumulators(owned: dict[str, torch.Tensor], program: Program | None,
                          world: int) -> dict[str, torch.Tensor]:
    """`owned` (fleetc's state) with copies of the gradient-merge accumulators averaged over the `world` ranks; the
    live tensors are left as they are. A collective: every rank calls it, in the same order (sorted names)."""
    if program is None or world == 1:
        return owned
    names = sorted(v.name for v in program.persistables() if v.kind is VarKind.ACCUMULATOR and v.name in owned)
    averaged = dict(owned)
    for name in names:
        total = owned[name].detach().clone()
        blocking_collective(f"checkpoint (averaging gradient-merge accumulator {name!r})", dist.all_reduce, total)
        averaged[name] = total.div_(world)
    return averaged
