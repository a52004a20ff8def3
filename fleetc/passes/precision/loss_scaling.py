"""Dynamic loss scaling for AMP: scale the backward seed, unscale and check all gradients in one op, and skip
the optimizer update (a conditional sub-block) on overflow, as Paddle's decorated optimizer does.
"""
from __future__ import annotations

from typing import Any

from fleetc.capture.to_program import LOSS_VAR, grad_name
from fleetc.ir.program import CONDITIONAL_BLOCK, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.usedef import Names
from fleetc.passes.base import PassReport

LOSS_SCALING = "loss_scaling"
NUM_GOOD_STEPS = "num_good_steps"
NUM_BAD_STEPS = "num_bad_steps"


def _attrs(role: OpRole) -> dict:
    return {"op_role": int(role), "module_path": "", "provenance": "amp"}


def _temp(program: Program, names: Names, base: str, like: Var) -> str:
    """A new temporary with `like`'s shape, dtype and device."""
    name = names.fresh(base)
    program.global_block.add_var(Var(name, like.shape, like.dtype, like.device))
    return name


def insert_loss_scaling(program: Program, cfg: Any, report: PassReport) -> None:
    """Rewrite a training Program for loss scaling; a Program without loss seed or optimizer is left alone."""
    block = program.global_block
    seed_index = next((i for i, op in enumerate(block.ops) if grad_name(LOSS_VAR) in op.defined), None)
    first_update = next((i for i, op in enumerate(block.ops) if OpRole.OPTIMIZE in op.role), None)
    if seed_index is None or first_update is None:
        report.notes.append("loss scaling: not applied (no backward seed or no optimizer update in this Program)")
        return
    seed = grad_name(LOSS_VAR)
    device = program.var(seed).device
    for name, dtype in ((LOSS_SCALING, "float32"), (NUM_GOOD_STEPS, "int32"), (NUM_BAD_STEPS, "int32")):
        block.add_var(Var(name, (), dtype, device, VarKind.COUNTER))
    names = Names(program)  # one scan: Program.unique_name rescans the Program per call (one per gradient)

    scaled = _temp(program, names, f"{seed}@SCALED", program.var(seed))
    for op in block.ops[seed_index + 1:]:
        op.rename_inputs({seed: scaled})
    block.ops.insert(seed_index + 1, Op(names.fresh("scale_loss_grad"), "fleetc.scale_loss_grad",
                                        (Ref(seed), Ref(LOSS_SCALING), float(cfg.init_loss_scaling)),
                                        outputs=[scaled, LOSS_SCALING], attrs=_attrs(OpRole.BACKWARD | OpRole.LOSS)))

    first_update += 1
    updates = block.ops[first_update:]
    inside = {n for op in updates for n in op.defined}  # a traced update's own temporaries are not gradients
    grads = list(dict.fromkeys(n for op in updates for n in op.inputs
                               if program.var(n).kind is VarKind.TEMP and n not in inside))
    unscaled = [_temp(program, names, f"{g}@UNSCALED", program.var(g)) for g in grads]
    found_inf = _temp(program, names, "found_inf", Var("", (1,), "float32", device))
    finite = _temp(program, names, "grads_finite", Var("", (1,), "bool", device))
    for op in updates:
        op.rename_inputs(dict(zip(grads, unscaled)))
    sub = program.new_block(0)
    sub.ops = updates
    block.ops[first_update:] = [
        Op(names.fresh("check_finite_and_unscale"), "fleetc.check_finite_and_unscale",
           ([Ref(g) for g in grads], Ref(LOSS_SCALING)), outputs=[*unscaled, found_inf], attrs=_attrs(OpRole.OPTIMIZE)),
        Op(names.fresh("grads_finite_check"), "aten.logical_not.default", (Ref(found_inf),), outputs=[finite],
           attrs=_attrs(OpRole.OPTIMIZE)),
        Op(names.fresh("update_if_grads_finite"), CONDITIONAL_BLOCK, (Ref(finite),), outputs=[],
           attrs={**_attrs(OpRole.OPTIMIZE), "sub_block": sub.idx}),
    ]
    if cfg.use_dynamic_loss_scaling:
        block.ops.append(Op(names.fresh("update_loss_scaling"), "fleetc.update_loss_scaling",
                            (Ref(found_inf), Ref(LOSS_SCALING), Ref(NUM_GOOD_STEPS), Ref(NUM_BAD_STEPS),
                             int(cfg.incr_every_n_steps), int(cfg.decr_every_n_nan_or_inf), float(cfg.incr_ratio),
                             float(cfg.decr_ratio)),
                            outputs=[LOSS_SCALING, NUM_GOOD_STEPS, NUM_BAD_STEPS], attrs=_attrs(OpRole.OPTIMIZE)))
    else:
        report.notes.append(f"loss scaling: static at {cfg.init_loss_scaling} (use_dynamic_loss_scaling=False)")
    report.count("gradients_unscaled", len(grads))
