"""Fused elementwise ops: add + activation, dropout + residual add, and their gradients.

Each reference is the aten sequence the pass replaced, so on CPU a fused op computes bit for bit
what the unfused ops computed, in one call. `POINTWISE` describes each op as an expression for
kernel generators (activations.py has the activations' own expressions).
"""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.registry import register_op
from fleetc.ops.activations import apply, apply_grad

aten = torch.ops.aten

POINTWISE = {
    "fleetc.fused_elemwise_add_act": "inter = x + y; out = act(inter)  if not act_first else  inter = act(y); out = x + inter",
    "fleetc.fused_elemwise_add_act_grad": "dx = act_grad(dout, saved)",
    "fleetc.fused_dropout_add": "mask = rand() >= p; out = x * mask / (1 - p) + residual",
    "fleetc.fused_dropout_add_grad": "dx = dout * mask * scale",
}


@register_op("fused_elemwise_add_act", "act(x + y) or x + act(y) in one op, also returning the intermediate",
             kernels={"cuda": "fleetc.codegen.triton.add_act:fused_elemwise_add_act"},
             kernel_sources="fleetc.codegen.triton.add_act:add_act_sources",
             cpu_kernel="fleetc.codegen.cpu.elementwise:plan_add_act")
def fused_elemwise_add_act(x: torch.Tensor, y: torch.Tensor, act_first: bool, act: str,
                           param: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """aten: `inter = add.Tensor(x, y); out = <act>(inter)`, or with `act_first`: `inter = <act>(y); out = add.Tensor(x, inter)`.

    Returns (out, inter); the pass keeps `inter` only when the backward reads it.
    """
    if act_first:
        inter = apply(act, y, param)
        return aten.add.Tensor(x, inter), inter
    inter = aten.add.Tensor(x, y)
    return apply(act, inter, param), inter


@register_op("fused_elemwise_add_act_grad", "gradient through the activation of a fused add+act",
             kernels={"cuda": "fleetc.codegen.triton.add_act:fused_elemwise_add_act_grad"},
             kernel_sources="fleetc.codegen.triton.add_act:add_act_grad_sources",
             cpu_kernel="fleetc.codegen.cpu.elementwise:plan_add_act_grad")
def fused_elemwise_add_act_grad(dout: torch.Tensor, saved: torch.Tensor | None, act: str, param: Any) -> torch.Tensor:
    """aten: `<act>_backward(dout, saved)` (e.g. `threshold_backward(dout, out, 0)` for relu).

    The add's own gradient is the identity, so this is the gradient of both addends (act(x+y)) or of
    the activated one (x + act(y)); broadcast addends keep their `sum` reductions after this op.
    """
    return apply_grad(act, dout, saved, param)


@register_op("fused_dropout_add", "dropout(x) + residual in one op, also returning the keep mask",
             cpu_kernel="fleetc.codegen.cpu.dropout:plan_dropout_add", draws_random=True)
def fused_dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """aten: `dropped, mask = native_dropout(x, p, train); out = add.Tensor(residual, dropped)`.

    Returns (out, mask). The mask is the small bool tensor native_dropout draws, kept for the backward:
    drawing it with the same call consumes the CPU generator exactly as eager dropout does, so compiled
    training matches eager under the same seed; a counter-based (seed, offset) regeneration needs a
    Philox generator, which a CUDA kernel can use but the CPU generator is not.
    """
    dropped, mask = aten.native_dropout.default(x, p, train)
    return aten.add.Tensor(residual, dropped), mask


@register_op("fused_dropout_add_grad", "gradient of a fused dropout+add with respect to the dropped input",
             cpu_kernel="fleetc.codegen.cpu.dropout:plan_dropout_add_grad")
def fused_dropout_add_grad(dout: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """aten: `native_dropout_backward(dout, mask, scale)`; the residual's gradient is `dout` itself."""
    return aten.native_dropout_backward.default(dout, mask, scale)
