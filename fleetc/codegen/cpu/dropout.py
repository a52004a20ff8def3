"""C++ kernels of `fleetc.fused_dropout_add` and its gradient: aten's dropout arithmetic in one pass.

The keep mask is drawn exactly as eager dropout draws it on CPU (`native_dropout` does
`mask = empty_like(x, bool).bernoulli_(1 - p)`), by that same aten call, so the CPU generator's stream and
every mask stay identical to eager training under the same seed (no counter-based RNG on CPU). The kernel then
computes `residual + (x * mask) * scale` in aten's order in one pass instead of three: bit for bit in fp32; in bf16
within one rounding (aten's scalar loops multiply by a bf16-rounded scale, its vector loops by the fp32 one).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fleetc.codegen.cpu.elementwise import StepsRunner, kernel_of, specialise
from fleetc.codegen.cpu.plan import CpuPlan, Unsupported
from fleetc.ir.program import Op, Var
from fleetc.ops.fused_elementwise import operand


def _dropout_add_steps(scale: float) -> tuple:
    """(x, mask, residual) → residual + (x * mask) * scale, as native_dropout then add.Tensor compute it."""
    x, mask, residual = operand(0), operand(1), operand(2)
    return (("aten.mul.Tensor", (x, mask), ()), ("aten.mul.Scalar", (operand(3), scale), ()),
            ("aten.add.Tensor", (residual, operand(4)), ()))


def dropout_scale(p: float) -> float:
    """native_dropout's scale: 1 / (1 - p), 0 when p == 1."""
    return 0.0 if 1.0 - p == 0 else 1.0 / (1.0 - p)


def plan_dropout_add(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_dropout_add` in training: aten draws the mask, one kernel does the rest."""
    x, residual = inputs[0], inputs[1]
    p, train = op.args[2], op.args[3]
    if not train:
        raise Unsupported("dropout in eval mode is a copy: the reference runs it")
    if tuple(residual.shape) != tuple(torch.broadcast_shapes(tuple(x.shape), tuple(residual.shape))):
        raise Unsupported("the residual is smaller than the dropped tensor")
    spec = specialise(f"fused_dropout_add_{x.dtype}", _dropout_add_steps(dropout_scale(p)), (5,),
                      [tuple(x.shape), tuple(x.shape), tuple(residual.shape)], [x.dtype, "bool", residual.dtype])

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = StepsRunner(spec, functions[0])

        def run(x: torch.Tensor, residual: torch.Tensor, p: float, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
            mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
            return runner(x, mask, residual), mask

        return run

    return CpuPlan((kernel_of(spec),), bind, exact=x.dtype == "float32")


def plan_dropout_add_grad(op: Op, inputs: list[Var | None]) -> CpuPlan:
    """`fleetc.fused_dropout_add_grad`: native_dropout_backward's `dout * mask * scale` in one pass."""
    dout, mask = inputs[0], inputs[1]
    steps = (("aten.native_dropout_backward.default", (operand(0), operand(1), op.args[2]), ()),)
    spec = specialise(f"fused_dropout_grad_{dout.dtype}", steps, (2,), [tuple(dout.shape), tuple(mask.shape)],
                      [dout.dtype, mask.dtype])

    def bind(functions: list[Any]) -> Callable[..., Any]:
        runner = StepsRunner(spec, functions[0])
        return lambda dout, mask, scale: runner(dout, mask)

    return CpuPlan((kernel_of(spec),), bind, exact=dout.dtype == "float32")
