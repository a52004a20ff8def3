"""Stage 2 on flat buckets under gradient merge: the accumulators are reduce-scattered once per k steps.

Gradient merge keeps one whole accumulator per gradient (persistent fleetc state: every step adds this rank's local
gradient to it, passes/data_parallel/merged.py), and allreduces each bucket of accumulators at the top of its
update block. Under flat stage 2 that allreduce becomes a reduce-scatter of the same bucket, laid out flat
(plan.FlatBucket): rank r keeps the averaged elements of its segment, and its pieces of the accumulators are views
of that shard (`<accumulator>@PIECE`), averaged by k into a new temporary (`…@AVG`). Everything in the update block
that read an accumulator (AMP's check, clipping, the update) reads this rank's average instead; the zeroing after
the update still resets the whole accumulator. Averaging of accumulators this rank has no piece of is dropped.
Stage 3 lays its buckets out by parameter (flat_params.py), so there the update block's allreduces are first
regrouped into those buckets (`regroup_merged`): each reduce-scatter then leaves this rank the merged gradient of
exactly the pieces of the parameters it holds. The accumulators themselves stay whole on every rank (each is the sum
of this rank's own local gradients, which only the reduce-scatter combines), counted on top of the stage's formula.
"""
from __future__ import annotations

from fleetc.ir.program import Op, OpRole, Program, Ref, Var
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.common import ALLOC, common_module, var_numel
from fleetc.passes.data_parallel.merged import (
    WAIT_INTO,
    insert_update_block_allreduces,
    merged_values,
    update_block,
    update_block_allreduces,
)
from fleetc.passes.sharding.plan import FlatBucket

RS_START = "fleetc.c_sharding_reduce_scatter_start"
RS_WAIT = "fleetc.c_sharding_reduce_scatter_wait"
SHARD_VIEWS = "fleetc.shard_views"
ZERO = "fleetc.zero"
AVERAGE = "fleetc.divide"


def merged_accumulators(program: Program) -> dict[str, str]:
    """Parameter → its gradient merge accumulator (the accumulator of its gradient or of AMP's fp32 cast of it)."""
    return {value.partition("@GRAD")[0]: acc for value, acc in merged_values(program).items()}


def merged_buckets(program: Program) -> list[list[str]]:
    """The parameters behind each bucket of accumulators the update block allreduces, in bucket order."""
    param_of = {acc: param for param, acc in merged_accumulators(program).items()}
    return [[param_of[ref.name] for ref in op.args[1]] for op in update_block_allreduces(program)]


def regroup_merged(program: Program, buckets: list[FlatBucket]) -> None:
    """Allreduce the accumulators in the update block by `buckets` (stage 3's parameter buckets: the accumulators of
    each bucket's parameters, in bucket order), replacing gradient merge's own buckets."""
    value_of = {value.partition("@GRAD")[0]: value for value in merged_values(program)}
    groups = [[value_of[p] for p in bucket.names if p in value_of] for bucket in buckets]
    algorithm = update_block_allreduces(program)[0].args[4]
    insert_update_block_allreduces(program, [group for group in groups if group], 1, algorithm, "sharding")


def scatter_merged(program: Program, buckets: list[FlatBucket], rank: int, degree: int, group: str, dp_group: str,
                   report: PassReport) -> dict[str, str]:
    """Replace each update-block allreduce of accumulators by a reduce-scatter over `group` (then summed over
    `dp_group`); later readers in the update block read this rank's pieces. Returns parameter → the Var of its piece
    of the merged gradient (whole-shaped where the piece is the whole parameter, else 1-D)."""
    block = update_block(program)
    accumulators = merged_accumulators(program)
    bucket_of = {name: bucket for bucket in buckets for name in bucket.names}
    param_of = {acc: param for param, acc in accumulators.items()}
    renamed: dict[str, str] = {}
    replaced: dict[str, list[Op]] = {}
    dropped: set[str] = set()
    for start in update_block_allreduces(program):
        accs = [ref.name for ref in start.args[1]]
        params = [param_of[a] for a in accs]
        bucket = bucket_of[params[0]]  # holds them all, in this order (maybe more: parameters without accumulator)
        start_of = dict(zip(bucket.names, bucket.starts))
        label = start.args[5]
        wait = next(op for op in block.ops if op.type == WAIT_INTO and op.args[1].name == start.outputs[0])
        first = program.var(accs[0])
        work = program.global_block.add_var(Var(program.unique_name(f"{label}@SHARD_WORK"), None, "work", first.device))
        shard = program.global_block.add_var(Var(program.unique_name(f"{label}@SHARD"), (bucket.segment,), first.dtype, first.device))
        attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": "sharding",
                 "module_path": common_module(program, accs)}
        ops = [Op(program.unique_name(f"{label}_reduce_scatter"), RS_START,
                  ([Ref(a) for a in accs], [start_of[p] for p in params], bucket.segment, group, dp_group, label), {},
                  [work.name],
                  dict(attrs)),
               Op(program.unique_name(f"{label}_reduce_scatter_wait"), RS_WAIT, (Ref(work.name),), {}, [shard.name],
                  dict(attrs))]
        mine, shapes = [], []
        for param, lo, hi in [piece for piece in bucket.pieces(rank) if piece[0] in params]:
            acc = accumulators[param]
            whole = (lo, hi) == (0, var_numel(program.var(acc)))
            piece = program.global_block.add_var(Var(program.unique_name(f"{acc}@PIECE"),
                                      program.var(acc).shape if whole else (hi - lo,), first.dtype, first.device))
            renamed[acc] = piece.name
            mine.append(piece.name)
            shapes.append(list(piece.shape))
        if mine:
            ops.append(Op(program.unique_name(f"{label}_owned_grads"), SHARD_VIEWS, (Ref(shard.name), shapes), {},
                          mine, {**attrs, "op_role": int(OpRole.OPTIMIZE)}))
        replaced[start.name], replaced[wait.name] = ops, []
        dropped.update((start.args[0].name, start.outputs[0]))  # the allreduce's buffer (and its allocation), handle
        report.count("reduce_scatter_buckets")
        report.count("padding_elements", bucket.padding(degree))
    ops: list[Op] = []
    for op in block.ops:
        if op.type == ALLOC and op.outputs[0] in dropped:
            continue
        if op.name in replaced:
            ops += replaced[op.name]
            continue
        if op.type == AVERAGE and op.args[0].name in accumulators.values():
            if op.args[0].name in renamed:  # the piece is a temporary, defined once: the average is a new one
                ops.append(_average(program, op, renamed))
            continue  # else another rank averages and updates this accumulator's elements
        if op.type != ZERO:
            op.rename_inputs(renamed)
            op.outputs = [renamed.get(name, name) for name in op.outputs]
        ops.append(op)
    block.ops = ops
    for name in dropped:
        block.vars.pop(name, None)
        program.global_block.vars.pop(name, None)
    report.notes.append("gradient merge: each bucket of whole accumulators is reduce-scattered once per k steps, "
                        "flat; this rank averages, checks, clips and updates its pieces (the accumulators stay "
                        "whole: on top of the formula)")
    return {param_of[acc]: piece for acc, piece in renamed.items()}


def _average(program: Program, divide: Op, renamed: dict[str, str]) -> Op:
    """Gradient merge's in-place averaging of an accumulator, as an op defining the average of this rank's piece of
    it; later readers of the accumulator read the average (`renamed` says so)."""
    acc, divisor = divide.args
    piece = program.var(renamed[acc.name])
    average = program.global_block.add_var(Var(program.unique_name(f"{piece.name}@AVG"), piece.shape, piece.dtype,
                                               piece.device))
    renamed[acc.name] = average.name
    return Op(program.unique_name(divide.name), "aten.div.Tensor", (Ref(piece.name), divisor), {}, [average.name],
              dict(divide.attrs))
