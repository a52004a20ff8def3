"""Fused gemm epilogue: matmul + bias [+ activation] forward, and dX, dW, dBias from one backward op."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.registry import register_op
from fleetc.ops.activations import apply, apply_grad

aten = torch.ops.aten


@register_op("fused_gemm_epilogue", "x @ w_t + bias, reshaped to the leading batch dims, then an activation",
             kernels={"cuda": "fleetc.codegen.triton.gemm:fused_gemm_epilogue"},
             kernel_sources="fleetc.codegen.triton.gemm:fused_gemm_epilogue_sources",
             cpu_kernel="fleetc.codegen.cpu.gemm:plan_gemm_epilogue")
def fused_gemm_epilogue(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor, out_shape: list | None,
                        act: str | None, param: Any, keep_pre_act: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """aten: `h = addmm(bias, x, w_t); h = view(h, out_shape)` (when given); `out = <act>(h)` (when given).

    Returns (out, h), h None unless `keep_pre_act`: the pass asks for it only when the backward reads it
    (the grads of gelu, silu and leaky_relu read their input), so the kernel neither allocates nor stores it.
    """
    h = aten.addmm.default(bias, x, w_t)
    if out_shape is not None:
        h = aten.view.default(h, out_shape)
    return (apply(act, h, param) if act else h), (h if keep_pre_act else None)


@register_op("fused_gemm_epilogue_grad", "backward of fused_gemm_epilogue: dX, dW and dBias in one op",
             kernels={"cuda": "fleetc.codegen.triton.gemm:fused_gemm_epilogue_grad"},
             kernel_sources="fleetc.codegen.triton.gemm:fused_gemm_epilogue_grad_sources",
             cpu_kernel="fleetc.codegen.cpu.gemm:plan_gemm_epilogue_grad")
def fused_gemm_epilogue_grad(dout: torch.Tensor, saved: torch.Tensor | None, x: torch.Tensor, w_t: torch.Tensor,
                             act: str | None, param: Any, output_mask: list) -> tuple[torch.Tensor | None, ...]:
    """aten: `g = <act>_backward(dout, saved)` (when an act); `g = view(g, [-1, n])`; `dx = mm(g, t(w_t))`;
    `dw = mm(t(g), x)`; `db = view(sum.dim_IntList(g, [0], True), [n])`; each only where `output_mask` asks.

    Returns (dx, dw, db); `dw` has the weight's own layout ([out, in]).
    """
    g = apply_grad(act, dout, saved, param) if act else dout
    g = aten.view.default(g, [-1, g.shape[-1]]) if g.dim() != 2 else g
    need_dx, need_dw, need_db = output_mask
    dx = aten.mm.default(g, aten.t.default(w_t)) if need_dx else None
    dw = aten.mm.default(aten.t.default(g), x) if need_dw else None
    db = aten.view.default(aten.sum.dim_IntList(g, [0], True), [g.shape[1]]) if need_db else None
    return dx, dw, db
