"""Gradient merge under data parallel: the merged gradients are allreduced once per k steps, in the update block.

Paddle's gradient merge communicates only in its update step. When gradient merge ran
(`metadata["gradient_merge"]`), the per-step ops get no gradient allreduce (every gradient flows
into an accumulator, maybe through AMP's fp32 cast, or nowhere): at the top of the update
sub-block, before the averaging by k and the update, each bucket's accumulators (`w@GRAD@MERGE`)
are copied into a flat buffer, allreduced, and the averages copied back into them (`fleetc.c_allreduce_wait_into`). The buffer is a copy, not the accumulators'
storage: accumulators are persistent fleetc state, each its own tensor (checkpointed by name), so
the copy in and out happens once per k steps. Every rank's step counter is the same, so every
rank enters the block together and collective order stays deterministic.
"""
from __future__ import annotations

import torch

from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel import common

WAIT_INTO = "fleetc.c_allreduce_wait_into"
ACCUMULATE = "fleetc.accumulate"


def merged_values(program: Program) -> dict[str, str]:
    """Value gradient merge accumulates (a gradient, or its fp32 cast under AMP) → its accumulator, in the order
    the per-step ops produce them (backward order); empty without gradient merge."""
    accumulators = program.metadata.get("gradient_merge", {}).get("accumulators", {})
    return {op.args[1].name: op.args[0].name for op in program.global_block.ops
            if op.type == ACCUMULATE and op.args[1].name in accumulators}


def update_block(program: Program) -> Block:
    """Gradient merge's conditional update sub-block."""
    return program.blocks[program.metadata["gradient_merge"]["update_block"]]


def update_block_allreduces(program: Program) -> list[Op]:
    """The bucket start ops in the update block, in order."""
    if "gradient_merge" not in program.metadata:
        return []
    return [op for op in update_block(program).ops if op.type == common.START]


def insert_update_block_allreduces(program: Program, buckets: list[list[str]], nccl_comm_num: int, algorithm: str,
                                   provenance: str) -> None:
    """Allreduce the accumulators of each bucket of merged values at the top of the update block (replacing any).

    Buckets go to the `nccl_comm_num` communicators round-robin.
    """
    block = update_block(program)
    accumulator = merged_values(program)
    kept = []
    for op in block.ops:
        if op.type in (common.ALLOC, common.START, WAIT_INTO) and OpRole.COLLECTIVE in op.role:
            for name in op.outputs:
                block.vars.pop(name, None)  # the buffer and the work handle; accumulators live in the global block
        else:
            kept.append(op)
    new_ops = []
    for index, grads in enumerate(buckets):
        new_ops += allreduce_into_ops(program, block, [accumulator[g] for g in grads],
                                      common.common_module(program, grads), index % nccl_comm_num, algorithm,
                                      f"merged_bucket{index}", provenance)
    block.ops = new_ops + kept


def allreduce_into_ops(program: Program, block: Block, accumulators: list[str], module_path: str, comm: int,
                       algorithm: str, label: str, provenance: str) -> list[Op]:
    """Ops averaging persistables across ranks in place, as one bucket: allocate its buffer in `block`, copy the
    persistables in and issue the allreduce, wait and copy the averages back (also local SGD's parameters)."""
    first = program.var(accumulators[0])
    numel = sum(common.var_numel(program.var(a)) for a in accumulators)
    flat = block.add_var(Var(program.unique_name(f"{label}@FLAT"), (numel,), first.dtype, first.device))
    pending = block.add_var(Var(program.unique_name(f"{label}@WORK"), None, "work", first.device))
    attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": provenance, "module_path": module_path}
    return [
        Op(program.unique_name(f"{label}_buffer"), common.ALLOC, ([numel],),
           {"dtype": first.torch_dtype, "device": torch.device(first.device)}, [flat.name], dict(attrs)),
        Op(program.unique_name(f"{label}_start"), common.START, (Ref(flat.name), [Ref(a) for a in accumulators],
                                                         [False] * len(accumulators), comm, algorithm, label),
           {}, [pending.name], dict(attrs)),
        Op(program.unique_name(f"{label}_wait"), WAIT_INTO, (Ref(flat.name), Ref(pending.name),
                                                            [Ref(a) for a in accumulators]),
           {}, list(accumulators), dict(attrs)),
    ]


def note_moved(program: Program, report: PassReport, collectives: int) -> None:
    """Say in `report` that the allreduce moved into the update block, and count its collectives per k steps."""
    k_steps = program.metadata["gradient_merge"]["k_steps"]
    report.stats["collectives_per_k_steps"] = collectives
    report.notes.append(f"gradient merge: the merged gradients are allreduced in the update block, before the "
                        f"averaging and update: {collectives} collective(s) every {k_steps} steps")


def skip_reason(program: Program) -> str | None:
    """Why a pass on the per-step gradient allreduces has nothing to do when only the update block has them."""
    if update_block_allreduces(program):
        return ("gradient merge: the gradients are allreduced in the update block, from the persistent "
                "accumulators copied into the bucket buffer, once per k steps")
    return None
