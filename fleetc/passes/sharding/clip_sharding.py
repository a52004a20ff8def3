"""Gradient clipping when a rank keeps only its gradient shards (stages 2 and 3).

Each clip op is narrowed to the gradients this rank still has (its own, and what AMP's unscaling made of
them); the others' updates are gone, so nobody reads their clipped values. Global-norm clipping then needs
every rank's share of the norm: the squared norm of the kept gradients (`program.metadata["grad_clip"]
["squared_norm"]`, its own op for this purpose) is sum-allreduced over the sharding group before the clip
reads it, so every rank scales by the same global norm. Data-parallel replicas of a shard hold the same,
already averaged, values, so they are not summed again. Per-gradient clipping (by norm, by value) needs
nothing more.
"""
from __future__ import annotations

from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var
from fleetc.passes.base import PassReport

CLIP_OPS = ("fleetc.squared_global_norm", "fleetc.clip_by_global_norm", "fleetc.clip_by_norm", "fleetc.clip_by_value")
NORM_SUM = "fleetc.c_sharding_norm_sum"


def clip_kept_gradients(program: Program, group: str, report: PassReport, foreign: frozenset[str] = frozenset()) -> None:
    """Narrow the clip ops to the gradients that still exist here, less `foreign` (gradient merge's accumulators of
    parameters this rank has no piece of: persistent, so they exist, but not averaged); sum the squared global norm
    over `group`."""
    available = {v.name for v in program.persistables()} | set(program.feeds) | {
        name for _, op in program.walk_ops() for name in op.defined}
    for block in program.blocks:
        ops: list[Op] = []
        for op in block.ops:
            if op.type not in CLIP_OPS:
                ops.append(op)
                continue
            kept = [ref for ref in op.args[0] if ref.name in available and ref.name not in foreign]
            if op.type == "fleetc.squared_global_norm":
                op.args = (kept, *op.args[1:])
                ops += [op, _sum_over_ranks(program, block, op, group)]
                report.count("clip_norm_allreduces")
                continue
            outputs = dict(zip((ref.name for ref in op.args[0]), op.outputs))
            for ref in op.args[0]:
                if ref not in kept:
                    block.vars.pop(outputs[ref.name], None)
            op.args, op.outputs = (kept, *op.args[1:]), [outputs[ref.name] for ref in kept]
            if kept:
                ops.append(op)
            report.count("clip_ops_narrowed")
        block.ops = ops


def _sum_over_ranks(program: Program, block: Block, norm: Op, group: str) -> Op:
    """The squared norm summed over the sharding group; later readers read the sum."""
    local = norm.outputs[0]
    var = program.find_var(local, block.idx)
    total = block.add_var(Var(program.unique_name(f"{local}@ALL_RANKS"), var.shape, var.dtype, var.device))
    for _, op in program.walk_ops():
        if op is not norm:
            op.rename_inputs({local: total.name})
    program.metadata["grad_clip"]["squared_norm"] = total.name
    return Op(program.unique_name("grad_clip_norm_sum"), NORM_SUM, (Ref(local), group), {}, [total.name],
              {"op_role": int(OpRole.COLLECTIVE), "provenance": "sharding"})
