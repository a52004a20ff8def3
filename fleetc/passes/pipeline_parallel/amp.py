"""AMP's loss scaling across pipeline stages: every stage skips the same steps and keeps the same scale.

The AMP pass (passes/precision/loss_scaling.py) ends the Program with one `check_finite_and_unscale` over every
gradient, which also sets `found_inf`, then the optimizer updates inside a conditional block that runs only when
the gradients are finite, then `update_loss_scaling`. Split across stages:

- the conditional block is inlined for the split (`inline_skip_block`): its ops are placed like any optimizer op,
  marked with the block they came from, and each stage's optimizer Program wraps its marked ops in a conditional
  block of its own again (`rewrap_skip_block`);
- each stage unscales the gradients it holds (a shared parameter's on every holder, so the copies stay equal) and
  computes its part of `found_inf`; `fleetc.pipeline_shared_sum` adds the parts over all stages in stage order, the
  mechanism global-norm clipping uses (clip.py), so every stage reads the same `found_inf` (a sum of 0/1 flags is
  non-zero exactly when their max is) and skips, or updates, together;
- every stage runs `update_loss_scaling` on that `found_inf`, so the scale and its good/bad step counters, which
  each stage holds, stay identical. Every stage starts its scale (`fleetc.start_loss_scaling`) before unscaling:
  otherwise only the last stage's backward, which scales the loss seed, does.

Under data parallel the check runs on the gradients the stage already averaged over its replicas (replicas.py),
so `found_inf` also agrees across the dp group with no further collective.
"""
from __future__ import annotations

from fleetc.errors import PassError
from fleetc.ir.program import CONDITIONAL_BLOCK, Op, Program, Ref
from fleetc.passes.pipeline_parallel.clip import gradient_holders, sum_over_stages
from fleetc.passes.pipeline_parallel.stages import is_optimize, where
from fleetc.passes.precision.loss_scaling import LOSS_SCALING

CHECK_FINITE = "fleetc.check_finite_and_unscale"
START = "fleetc.start_loss_scaling"
SCALE_SEED = "fleetc.scale_loss_grad"
SKIP_BLOCK = "pipeline_skip_block"  # attr of an inlined op: the conditional block op it came from


def inline_skip_block(program: Program) -> None:
    """Inline the global block's conditional optimizer blocks (AMP's skip on overflow), marking each inlined op
    with its block's conditional op (name, condition and attrs), and drop the sub-blocks. Any other sub-block is a
    PassError: it cannot be split across stages."""
    block = program.global_block
    ops: list[Op] = []
    for op in block.ops:
        if op.type != CONDITIONAL_BLOCK:
            ops.append(op)
            continue
        inner = program.blocks[op.sub_block].ops
        if not is_optimize(op) or any(not is_optimize(o) or o.sub_block is not None for o in inner):
            raise PassError(f"{where(op)}: a conditional block of non-optimizer ops cannot be split across pipeline "
                            "stages")
        marker = {"name": op.name, "cond": op.args[0].name,
                  "attrs": {k: v for k, v in op.attrs.items() if k != "sub_block"}}
        for inner_op in inner:
            inner_op.attrs[SKIP_BLOCK] = marker
            ops.append(inner_op)
    if len(program.blocks) > 1 and any(o.sub_block is not None for o in ops):
        raise PassError("the pipeline split needs a single-block Program")
    block.ops = ops
    del program.blocks[1:]


def split_found_inf(program: Program, param_stages: dict[str, list[int]], count: int) -> dict[str, str]:
    """Replace the check_finite_and_unscale op by one per stage over the gradients it holds, each summing its part
    of found_inf over all stages (see the module docstring). Returns unscaled gradient → gradient."""
    block = program.global_block
    holders = gradient_holders(program, param_stages)
    aliases: dict[str, str] = {}
    ops: list[Op] = []
    for op in block.ops:
        if op.type != CHECK_FINITE:
            ops.append(op)
            continue
        names = [ref.name for ref in op.args[0]]
        unknown = [n for n in names if n not in holders]
        if unknown:
            raise PassError(f"{where(op)} unscales {unknown[0]!r}, which is no parameter's gradient: it cannot be "
                            "placed on a pipeline stage")
        aliases.update(zip(op.outputs[:-1], names))
        ops += _start_scale(program, op, count)
        for s in range(count):
            ops += _check_part(program, op, [i for i, n in enumerate(names) if s in holders[n]], s, count)
    block.ops = ops
    return aliases


def _start_scale(program: Program, check: Op, count: int) -> list[Op]:
    """`start_loss_scaling` on every stage, with the initial scale of the loss seed's scaling op (a no-op on the
    stage whose backward already started it)."""
    seed = next((op for op in program.global_block.ops if op.type == SCALE_SEED), None)
    if seed is None:
        return []
    return [Op(f"start_loss_scaling@stage{s}", START, (Ref(LOSS_SCALING), seed.args[2]), outputs=[LOSS_SCALING],
               attrs={**check.attrs, "op_device": f"stage:{s}"}) for s in range(count)]


def _check_part(program: Program, op: Op, mine: list[int], s: int, count: int) -> list[Op]:
    """Stage s unscales its gradients into its part of found_inf, then the parts are summed into found_inf."""
    found_inf = program.var(op.outputs[-1])
    attrs = {**op.attrs, "op_device": f"stage:{s}"}
    part, total = sum_over_stages(program, found_inf, s, count, op.name, attrs)
    if mine:
        grads = [op.args[0][i] for i in mine]
        check = Op(f"{op.name}@stage{s}", op.type, (grads, *op.args[1:]), dict(op.kwargs),
                   [*(op.outputs[i] for i in mine), part], attrs)
    else:
        check = Op(f"{op.name}@stage{s}", "aten.zeros.default", (list(found_inf.shape),),
                   {"dtype": found_inf.torch_dtype}, outputs=[part], attrs=attrs)
    return [check, total]


def rewrap_skip_block(sub: Program) -> None:
    """In one stage's optimizer Program: put the ops marked by `inline_skip_block` back into a conditional block
    (one per original block, where its first op was)."""
    block = sub.global_block
    ops: list[Op] = []
    blocks: dict[str, list[Op]] = {}
    for op in block.ops:
        marker = op.attrs.pop(SKIP_BLOCK, None)
        if marker is None:
            ops.append(op)
            continue
        if marker["name"] not in blocks:
            inner = sub.new_block(0)
            blocks[marker["name"]] = inner.ops
            if marker["cond"] not in block.vars:
                raise PassError(f"pipeline stage optimizer: the skip condition {marker['cond']!r} is not computed "
                                "on this stage")
            ops.append(Op(marker["name"], CONDITIONAL_BLOCK, (Ref(marker["cond"]),), outputs=[],
                          attrs={**marker["attrs"], "sub_block": inner.idx}))
        blocks[marker["name"]].append(op)
    block.ops = ops

