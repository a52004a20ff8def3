"""CPU kernels around the gemm epilogue ops: the matmuls stay with oneDNN/MKL through aten, fusion owns the epilogue.

Forward: `addmm(bias, x, w_t)` (the bias folded into the matmul, as the reference does), then one C++ pass
applies the activation, in place on the matmul's output unless the backward keeps the pre-activation.
Backward: one C++ pass computes the activation's gradient `g` from `dout` (and the saved value) and, in the same
pass, dBias as the column sums of `g`; then aten's `mm` computes dX and dW from `g`. Without an activation the
ops are only aten calls and run their reference.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fleetc.codegen.cpu.elementwise import StepsRunner, kernel_of, specialise
from fleetc.codegen.cpu.plan import CpuPlan, Unsupported
from fleetc.ir.program import Op, Var
from fleetc.ops.activations import ACTIVATIONS, activation_call, activation_grad_call
from fleetc.ops.fused_elementwise import operand

aten = torch.ops.aten


def _act_tag(act: str, param: Any) -> str:
    return f"{act}_tanh" if act == "gelu" and param == "tanh" else act


def plan_gemm_epilogue(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_gemm_epilogue`: aten addmm, then the activation in one pass (in place unless h is kept)."""
    x, w_t = inputs[0], inputs[1]
    act, param, keep_pre_act = op.args[4], op.args[5], op.args[6]
    if act is None:
        raise Unsupported("no activation: the op is one addmm")
    m, n = x.shape[0], w_t.shape[1]
    steps = (activation_call(act, operand(0), param),)
    spec = specialise(f"gemm_epilogue_{_act_tag(act, param)}", steps, (1,), [(m, n)], [x.dtype])
    in_place = not keep_pre_act

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = StepsRunner(spec, functions[0])

        def run(x, w_t, bias, out_shape, act, param, keep_pre_act):
            h = aten.addmm.default(bias, x, w_t)
            out = runner.into(h, out=h) if in_place else runner(h)
            if out_shape is not None:
                h, out = aten.view.default(h, out_shape), aten.view.default(out, out_shape)
            return out, (h if keep_pre_act else None)

        return run

    return CpuPlan((kernel_of(spec),), bind, exact=spec.exact)


def plan_gemm_epilogue_grad(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_gemm_epilogue_grad`: act grad and dBias in one pass, dX and dW by aten's mm."""
    dout, saved = inputs[0], inputs[1]
    act, param, output_mask = op.args[4], op.args[5], op.args[6]
    if act is None:
        raise Unsupported("no activation: dBias is one aten sum beside the matmuls")
    n = dout.shape[-1]
    m = math.prod(dout.shape) // n if n else 0
    reads_saved = ACTIVATIONS[act].saves is not None
    steps = (activation_grad_call(act, operand(0), operand(1) if reads_saved else None, param),)
    need_db = bool(output_mask[2])
    if need_db:
        steps += (("aten.sum.dim_IntList", (operand(1 + reads_saved), (0,), False), ()),)
    shapes = [(m, n)] * (1 + reads_saved)
    dtypes = [dout.dtype] + ([saved.dtype] if reads_saved else [])
    results = (1 + reads_saved, 2 + reads_saved) if need_db else (1 + reads_saved,)
    spec = specialise(f"gemm_epilogue_{_act_tag(act, param)}_grad" + "_dbias" * need_db, steps, results, shapes, dtypes)

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = StepsRunner(spec, functions[0])

        def run(dout, saved, x, w_t, act, param, output_mask):
            flat = [dout.reshape(m, n)] + ([saved.reshape(m, n)] if reads_saved else [])
            produced = runner(*flat)
            g, db = produced if need_db else (produced, None)
            need_dx, need_dw, _ = output_mask
            dx = aten.mm.default(g, aten.t.default(w_t)) if need_dx else None
            dw = aten.mm.default(aten.t.default(g), x) if need_dw else None
            return dx, dw, db

        return run

    return CpuPlan((kernel_of(spec),), bind, exact=spec.exact and not need_db)
