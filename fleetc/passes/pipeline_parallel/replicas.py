"""Pipeline × data parallel: each stage averages its gradients across the data-parallel replicas of that stage.

On a process mesh with dp replicas of a pp-stage pipeline (fleetc/comm/mesh.py), the ranks that hold the same stage
of different replicas form a `dp` group. Each stage sums its gradients over the micro-batches (the executor does,
from the backward Programs' `grad:` fetches), and its optimizer Program starts by averaging those sums over its dp
group in one bucket: one allreduce per stage per step, after accumulation, as Paddle does, instead of one per
micro-batch. The per-step allreduce pass leaves pipelined Programs alone (`split.pipelined`) for this reason.

The backward Programs fetch a gradient `g` under `grad:g@LOCAL`; the optimizer Program reads `g@LOCAL` and the
allreduce's wait defines `g`, so the updates are untouched. The group's ranks come from the trainer, in
`metadata["data_parallel"]["groups"]` (the mesh's dp partition); the split records them as the Program's `dp:0`
communicator group, which the runtime creates before the first step.
"""
from __future__ import annotations

from fleetc.comm.collectives import FLAT
from fleetc.comm.groups import group_partitions
from fleetc.ir.program import Op, Program, Var
from fleetc.passes.data_parallel.allreduce import allreduce_ops, data_parallel_world
from fleetc.passes.data_parallel.common import LOCAL_SUFFIX


def replica_count(program: Program) -> int:
    """How many data-parallel replicas each pipeline stage has (1: none to average over)."""
    return data_parallel_world(program)


def local_name(grad: str, replicas: int) -> str:
    """The name a stage's micro-batch gradient sum travels under to its optimizer Program."""
    return grad + LOCAL_SUFFIX if replicas > 1 else grad


def average_over_replicas(program: Program, stage: int, grads: list[str]) -> list[Op]:
    """The ops, to run first in stage `stage`'s optimizer Program, that average `grads` (read as `<g>@LOCAL`) over
    the stage's data-parallel group in one bucket and define each `<g>` again. Declares the Vars they use."""
    block = program.global_block
    for grad in grads:
        var = block.vars[grad]
        block.add_var(Var(grad + LOCAL_SUFFIX, var.shape, var.dtype, var.device))
    return list(allreduce_ops(program, grads, 0, FLAT, f"pipeline_stage{stage}_grads", "pipeline_split"))


def record_groups(program: Program) -> None:
    """Name the dp group the stages' allreduces use (`dp:0`) in `metadata["collective_groups"]`."""
    meta = program.metadata["data_parallel"]
    program.metadata["collective_groups"] = {
        "dp:0": meta.get("groups") or group_partitions(meta["world_size"], 1, 1, False)["dp:0"]}
