"""use_pure_fp16: low-precision parameters updated through float32 master copies kept in the optimizer's state.

Each optimizer update of a low-precision parameter (the ops whose `param` attribute names it: one
hand-written op, or a traced update's aten ops) is redirected to a float32 Var `<param>@master_weight`,
bound like any optimizer state to `optimizer.state[param]["master_weight"]` (so `optimizer.state_dict()`
carries it); an assign after the update's last op rounds the updated master into the parameter. The
runtime (fleetc/runtime/state.py) seeds the master from the float32 parameter before converting the module.
"""
from __future__ import annotations

from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.usedef import Names
from fleetc.ops.optimizer import MASTER_KEY
from fleetc.passes.base import PassReport


def keep_master_weights(program: Program, low_params: set[str], report: PassReport) -> None:
    """Point every update of a parameter in `low_params` at its float32 master and round the result back."""
    block = program.global_block
    bindings = program.metadata.setdefault("state_bindings", {})
    last_op = {op.attrs["param"]: op.name for op in block.ops
               if OpRole.OPTIMIZE in op.role and op.attrs.get("param") in low_params}
    ops: list[Op] = []
    names = Names(program)  # one scan: Program.unique_name rescans the Program per call (one per parameter)
    for op in block.ops:
        ops.append(op)
        param = op.attrs.get("param") if OpRole.OPTIMIZE in op.role else None
        if param not in low_params:
            continue
        master = f"{param}@{MASTER_KEY}"
        if program.find_var(master) is None:
            source = program.var(param)
            block.add_var(Var(master, source.shape, "float32", source.device, VarKind.OPTIMIZER_STATE))
            bindings[master] = [param, MASTER_KEY]
            report.count("master_weights")
        op.rename_inputs({param: master})
        op.outputs = [master if name == param else name for name in op.outputs]
        if op.name == last_op[param]:
            attrs = {k: op.attrs[k] for k in ("op_role", "module_path") if k in op.attrs}
            ops.append(Op(names.fresh(f"{param}.round_master"), "fleetc.assign", (Ref(param), Ref(master)),
                          outputs=[param], attrs={**attrs, "provenance": "amp"}))
    block.ops = ops
    if low_params:
        report.notes.append(f"use_pure_fp16: {len(low_params)} parameters in {program.var(min(low_params)).dtype}, "
                            f"{report.stats.get('master_weights', 0)} float32 master weights in the optimizer state")
