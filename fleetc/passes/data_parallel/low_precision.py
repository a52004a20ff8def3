"""use_pure_fp16 × data parallel: a low-precision parameter's gradient is averaged in the parameter's dtype.

Paddle (pure fp16 / O2 without master_grad) and torch DDP communicate a parameter's gradient in the parameter's
own dtype; under `use_pure_fp16` the parameters are low precision, so the ranks average (or, sharded,
reduce-scatter) the low-precision `<param>@GRAD` and a rank keeps only low-precision gradients (the memory
table's `use_pure_fp16` row, docs/sharding.md). The float32 cast that feeds the master weight's update moves
after the average, into the update section, so AMP's unscaling and overflow check, clipping and the update
read the cast of the averaged gradient. A gradient computed in float32 (a reduction accumulating in float32,
e.g. a bias's) is rounded to the parameter's dtype first, as eager autograd gives it. Under gradient merge and
pipeline the float32 accumulators are what is averaged instead (passes/data_parallel/merged.py, partition.py).

Paddle's `fp16_allreduce` does the same to float32 gradients (`average_in_low_precision`): each is cast to low
precision for the average and back to float32 after it.
"""
from __future__ import annotations

import torch

from fleetc.capture.to_program import rename_temporaries
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, OpRole, Program, Ref, Var
from fleetc.ops.optimizer import MASTER_KEY
from fleetc.passes.data_parallel.common import AMP_CAST, GRAD_SUFFIX, is_backward


def _readers(program: Program, name: str) -> list[Op]:
    """Every op of the Program that reads `name`."""
    return [op for _, op in program.walk_ops() if name in op.inputs]


def _round_to(program: Program, grad: str, dtype: str) -> str:
    """Rename a float32 gradient `<g>@float32` and define `<g>` as its cast to `dtype` right after its producer;
    returns the float32 name."""
    block = program.global_block
    full = program.unique_name(f"{grad}@{block.vars[grad].dtype}")  # the rank's own float32 value
    rename_temporaries(program, {grad: full})
    for sub_block in program.blocks[1:]:
        for op in sub_block.ops:
            op.rename_inputs({grad: full})
    producer = next(i for i, op in enumerate(block.ops) if full in op.outputs)
    source = block.vars[full]
    block.add_var(Var(grad, source.shape, dtype, source.device))
    attrs = {k: block.ops[producer].attrs[k] for k in ("op_role", "module_path") if k in block.ops[producer].attrs}
    block.ops.insert(producer + 1, Op(program.unique_name(f"{grad}.cast_{dtype}"), AMP_CAST, (Ref(full),),
                                      {"dtype": getattr(torch, dtype)}, [grad],
                                      {**attrs, "provenance": "insert_allreduce"}))
    return full


def _average_in(program: Program, grad: str, dtype: str) -> Op | None:
    """Make `grad` the `dtype` value the ranks average; returns the float32 cast of it that the update section now
    reads instead (placed by `_place`), or None where `grad` is left alone: a fetched gradient, one no update reads,
    or one whose float32 cast a backward op also reads."""
    block = program.global_block
    if block.vars[grad].dtype == dtype:  # AMP cast it up to float32 in backward: move that cast after the average
        cast = next((op for op in block.ops if op.type == AMP_CAST and op.args[0] == Ref(grad)
                     and block.vars[op.outputs[0]].dtype == "float32"), None)
        if cast is None or any(is_backward(op) for op in _readers(program, cast.outputs[0])):
            return None
        block.ops.remove(cast)
        cast.attrs.pop("forward_op", None)
        cast.attrs.update(op_role=int(OpRole.OPTIMIZE), provenance="insert_allreduce")
        return cast
    if grad in program.fetches.values() or all(is_backward(op) for op in _readers(program, grad)):
        return None
    full = _round_to(program, grad, dtype)
    up = block.add_var(Var(program.unique_name(f"{grad}@FP32"), block.vars[full].shape, "float32",
                           block.vars[full].device))
    for op in _readers(program, full):
        if not is_backward(op):
            op.rename_inputs({full: up.name})
    return Op(program.unique_name(f"{grad}.cast_fp32"), AMP_CAST, (Ref(grad),), {"dtype": torch.float32},
              [up.name], {"op_role": int(OpRole.OPTIMIZE), "provenance": "insert_allreduce",
                          "module_path": grad.removesuffix(GRAD_SUFFIX).rpartition(".")[0]})


def _place(program: Program, casts: list[Op]) -> None:
    """Each float32 cast right before the first global op reading it (the update section's start)."""
    block = program.global_block
    for cast in casts:
        first = next(i for i, op in enumerate(block.ops) if cast.outputs[0] in block_reads(program, op))
        block.ops.insert(first, cast)


def average_in_parameter_dtype(program: Program, grads: list[str]) -> list[str]:
    """use_pure_fp16: make each gradient of a parameter with a float32 master weight the low-precision value the
    ranks average, and the update read its float32 cast taken after the average. Returns the gradients it handled
    (the others keep name_full_precision_gradients' float32 average)."""
    casts = {grad: _average_in(program, grad, program.var(grad.removesuffix(GRAD_SUFFIX)).dtype) for grad in grads
             if program.find_var(f"{grad.removesuffix(GRAD_SUFFIX)}@{MASTER_KEY}") is not None}
    _place(program, [cast for cast in casts.values() if cast is not None])
    return [grad for grad, cast in casts.items() if cast is not None]


def average_in_low_precision(program: Program, grads: list[str]) -> list[str]:
    """Paddle's `fp16_allreduce`: each float32 gradient is cast to low precision (float16 on CUDA, as Paddle,
    bfloat16 elsewhere) for the average and back to float32 after it, halving the bytes sent. Returns the
    gradients it handled."""
    block = program.global_block
    casts = {grad: _average_in(program, grad, "float16" if "cuda" in str(block.vars[grad].device) else "bfloat16")
             for grad in grads if block.vars[grad].dtype == "float32"}
    _place(program, [cast for cast in casts.values() if cast is not None])
    return [grad for grad, cast in casts.items() if cast is not None]
