"""In-place pointwise ops (`build_strategy.enable_inplace`): `y = relu(x)` becomes `y = relu_(x)` when x dies there.

The result then shares x's storage, so the step holds one buffer where it held two. Liveness (fleetc/ir/liveness.py)
says where each temporary dies. An op is rewritten only when that is safe and changes no bit:

- the op is a pointwise aten op whose in-place overload (`relu_.default`) takes the same arguments, and the in-place
  kernel computes the same values (the same TensorIterator loop, writing to self);
- its first argument is a temporary defined in the same block by an aten op that returned fresh storage (not a view,
  not a fleetc op, which may return views of buffers such as an allreduce bucket), of which no view exists, that
  no later op (in this block or a sub-block) reads and no fetch names: saved tensors of recompute and gradient merge,
  and gradients a collective still reads, are read later, so they are never overwritten;
- it appears once among the arguments, and the result has its dtype, shape and device (no broadcast, no promotion).

The rewritten op writes its input in place (its schema says so), so the multi-threaded scheduler orders it after
every earlier reader of that input (fleetc/runtime/dependencies.py): no buffer is overwritten while a worker may
still read it.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from fleetc.ir.liveness import aliased_input, last_use_index
from fleetc.ir.program import Block, Program, Ref, VarKind, iter_refs
from fleetc.ir.registry import resolve_callable
from fleetc.passes.base import PassReport


@functools.cache
def inplace_variant(op_type: str) -> str | None:
    """`aten.relu_.default` for `aten.relu.default`: the in-place overload of a pointwise aten op with the same
    arguments, writing its first argument `self`; None when there is none."""
    if not op_type.startswith("aten."):
        return None
    _, packet, overload = op_type.split(".")
    try:
        functional = resolve_callable(op_type)
        inplace = getattr(getattr(torch.ops.aten, packet + "_"), overload)
    except (AttributeError, KeyError):
        return None
    if torch.Tag.pointwise not in functional.tags:
        return None
    args, inplace_args = functional._schema.arguments, inplace._schema.arguments
    if [(a.name, str(a.type)) for a in args] != [(a.name, str(a.type)) for a in inplace_args] or not args:
        return None
    if args[0].name != "self" or inplace_args[0].alias_info is None or not inplace_args[0].alias_info.is_write:
        return None
    return f"aten.{packet}_.{overload}"


def fresh_temporaries(program: Program, block: Block) -> set[str]:
    """Temporaries of `block` that an aten op returned as new storage and that no view shares."""
    fresh, viewed = set(), set()
    for op in block.ops:
        for j, name in enumerate(op.outputs):
            if name is None:
                continue
            base = aliased_input(op, j)
            if base is not None:
                viewed.update((name, base))
            elif op.type.startswith("aten.") and program.var(name, block.idx).kind is VarKind.TEMP:
                fresh.add(name)
    for op in block.ops:  # views made inside sub-blocks count too
        if op.sub_block is not None:
            for inner in program.blocks[op.sub_block].ops:
                viewed.update(n for j, n in enumerate(inner.outputs) if n and aliased_input(inner, j) is not None)
                viewed.update(filter(None, (aliased_input(inner, j) for j in range(len(inner.outputs)))))
    return fresh - viewed


def same_type(program: Program, block: Block, a: str, b: str) -> bool:
    va, vb = program.var(a, block.idx), program.var(b, block.idx)
    return (va.shape is not None and tuple(va.shape) == tuple(vb.shape or ()) and va.dtype == vb.dtype
            and va.device == vb.device)


def plan_inplace(program: Program, block: Block, keep: set[str]) -> list[tuple[int, str]]:
    """(op index, in-place op type) of every op of `block` that can write over its first input."""
    dead_after = last_use_index(program, block, keep)
    fresh = fresh_temporaries(program, block) - keep
    planned = []
    for i, op in enumerate(block.ops):
        variant = inplace_variant(op.type)
        if variant is None or not op.args or not isinstance(op.args[0], Ref) or len(op.defined) != 1:
            continue
        source, result = op.args[0].name, op.outputs[0]
        uses = [*iter_refs(op.args), *iter_refs(op.kwargs)].count(source)
        if (source in fresh and dead_after.get(source) == i and uses == 1 and result is not None
                and same_type(program, block, source, result)):
            planned.append((i, variant))
            fresh.discard(source)
    return planned


class InplacePointwise:
    name = "inplace_pointwise"
    enabled_by = "build_strategy.enable_inplace"
    summary = "pointwise ops write their result over an input that dies there (one buffer instead of two)"
    reads: tuple[str, ...] = ("build_strategy.enable_inplace",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fetched = set(program.fetches.values())
        for block in program.blocks:
            keep = fetched
            if block.idx != 0:  # a sub-block's temporaries may be read after it, by its parent
                keep = fetched | {n for other in program.blocks if other is not block for op in other.ops
                                  for n in op.inputs}
            for i, variant in plan_inplace(program, block, keep):
                block.ops[i].type = variant
                report.count("ops_in_place")
        report.changed = bool(report.stats)
        if not report.changed:
            report.skipped_reason = "no pointwise op has an input that dies there and that it could overwrite"
        return program, report
