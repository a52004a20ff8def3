"""Gradient clipping across pipeline stages: each stage clips the gradients it holds, by the same global norm.

`fleetc.compile(grad_clip=...)` puts one clip op over every gradient into the optimize section (passes/optimizers/
clip.py). Split across stages, each stage gets that op over its own gradients (a shared parameter's, such as tied
embeddings, on every stage that holds a copy, so the copies stay equal). Clipping by value or by each gradient's
own norm needs nothing more. Clipping by the global norm needs the norm of all gradients: each stage computes the
squared norm of its part (a shared parameter's gradient counted once, on its first holder), and
`fleetc.pipeline_shared_sum` adds the parts over all stages in stage order, so every stage scales by the same value,
bit for bit. Under data parallel the parts are of the averaged gradients (the allreduce runs first).

The per-stage ops carry `op_device="stage:N"`, which places them (partition.py's optimizer placement honours it).
"""
from __future__ import annotations

from fleetc.errors import PassError
from fleetc.ir.program import Op, OpRole, Program, Ref, Var
from fleetc.passes.pipeline_parallel.stages import annotated_stage, where

SQUARED_NORM = "fleetc.squared_global_norm"
GLOBAL = "fleetc.clip_by_global_norm"
PER_GRADIENT = ("fleetc.clip_by_norm", "fleetc.clip_by_value")


def gradient_holders(program: Program, param_stages: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each parameter gradient → the stages holding its parameter (the first stage for one placed nowhere)."""
    grads = program.metadata.get("optimizer", {}).get("grads", {})
    return {grad: param_stages.get(param, [0]) for param, grad in grads.items()}


def split_clip_ops(program: Program, param_stages: dict[str, list[int]], count: int,
                   aliases: dict[str, str] | None = None) -> None:
    """Replace each clip op over several stages' gradients by one per stage (see the module docstring). `aliases`
    names other Vars holding a gradient (AMP's unscaled copies) → that gradient."""
    block = program.global_block
    holders = gradient_holders(program, param_stages)
    holders.update({alias: holders[grad] for alias, grad in (aliases or {}).items() if grad in holders})
    ops: list[Op] = []
    for op in block.ops:
        if op.type not in (SQUARED_NORM, GLOBAL, *PER_GRADIENT) or annotated_stage(op) is not None:
            ops.append(op)
            continue
        names = [ref.name for ref in op.args[0]]
        unknown = [n for n in names if n not in holders]
        if unknown:
            raise PassError(f"{where(op)} clips {unknown[0]!r}, which is no parameter's gradient: it cannot be "
                            "placed on a pipeline stage")
        for s in range(count):
            if op.type == SQUARED_NORM:
                ops += _squared_norm_part(program, op, [n for n in names if holders[n][0] == s], s, count)
                continue
            mine = [i for i, n in enumerate(names) if s in holders[n]]
            if mine:
                args = ([op.args[0][i] for i in mine], *op.args[1:])
                ops.append(Op(f"{op.name}@stage{s}", op.type, args, dict(op.kwargs), [op.outputs[i] for i in mine],
                              {**op.attrs, "op_device": f"stage:{s}"}))
    block.ops = ops


def _squared_norm_part(program: Program, op: Op, names: list[str], s: int, count: int) -> list[Op]:
    """Stage s's squared norm of its gradients, then the sum over all stages into the op's output."""
    total = program.var(op.outputs[0])
    attrs = {**op.attrs, "op_device": f"stage:{s}"}
    part, total_sum = sum_over_stages(program, total, s, count, op.name, attrs)
    compute = (Op(f"{op.name}@stage{s}", op.type, ([Ref(n) for n in names],), outputs=[part], attrs=dict(attrs))
               if names else
               Op(f"{op.name}@stage{s}", "aten.zeros.default", ([],), {"dtype": total.torch_dtype},
                  outputs=[part], attrs=dict(attrs)))
    return [compute, total_sum]


def sum_over_stages(program: Program, total: Var, s: int, count: int, op_name: str, attrs: dict) -> tuple[str, Op]:
    """Stage s's part of `total` (a new Var `<total>@stage<s>`, for the caller to compute) and the op that adds
    the parts of all `count` stages, in stage order, into `total` on stage s: every stage gets the same value, bit
    for bit. Used for the squared global norm here and for AMP's found_inf (amp.py)."""
    part = program.global_block.add_var(Var(f"{total.name}@stage{s}", total.shape, total.dtype, total.device))
    total_sum = Op(f"{op_name}@sum{s}", "fleetc.pipeline_shared_sum", (Ref(part.name), list(range(count)),
                                                                       f"shared:{total.name}"),
                   outputs=[total.name], attrs={**attrs, "op_role": int(OpRole.OPTIMIZE | OpRole.COLLECTIVE)})
    return part.name, total_sum
