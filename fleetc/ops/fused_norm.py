"""Fused batch norm + activation (and + residual add) ops, forward and backward, train and eval."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.registry import register_op
from fleetc.ops.activations import apply, apply_grad

aten = torch.ops.aten


def _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    # The in-place variant updates running stats itself: same kernel as the functional one plus copies.
    if training:
        return aten._native_batch_norm_legit.default(x, weight, bias, running_mean, running_var, True, momentum, eps)
    return aten._native_batch_norm_legit_no_training.default(x, weight, bias, running_mean, running_var, momentum, eps)


@register_op("fused_bn_act", "batch norm + activation; training updates the running statistics in place",
             kernels={"cuda": "fleetc.codegen.triton.norm:fused_bn_act"},
             kernel_sources="fleetc.codegen.triton.norm:fused_bn_sources",
             cpu_kernel="fleetc.codegen.cpu.norm:plan_bn_act")
def fused_bn_act(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, running_mean: torch.Tensor,
                 running_var: torch.Tensor, training: bool, momentum: float, eps: float, act: str,
                 param: Any) -> tuple[torch.Tensor, ...]:
    """aten (training): `bn, mean, rstd, new_rm, new_rv = _native_batch_norm_legit_functional(x, w, b, rm, rv, True,
    momentum, eps); assign(rm, new_rm); assign(rv, new_rv); out = <act>(bn)`;
    (eval): `bn, _, _ = _native_batch_norm_legit_no_training(x, w, b, rm, rv, momentum, eps); out = <act>(bn)`.

    Returns (out, bn, mean, rstd).
    """
    normed, mean, rstd = _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    return apply(act, normed, param), normed, mean, rstd


@register_op("fused_bn_add_act", "batch norm + residual add + activation (ResNet block tail)",
             kernels={"cuda": "fleetc.codegen.triton.norm:fused_bn_add_act"},
             kernel_sources="fleetc.codegen.triton.norm:fused_bn_sources",
             cpu_kernel="fleetc.codegen.cpu.norm:plan_bn_add_act")
def fused_bn_add_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
                     eps: float, act: str, param: Any) -> tuple[torch.Tensor, ...]:
    """aten: as fused_bn_act, with `pre = add.Tensor(bn, residual); out = <act>(pre)`. Returns (out, pre, mean, rstd)."""
    normed, mean, rstd = _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)
    pre = aten.add.Tensor(normed, residual)
    return apply(act, pre, param), pre, mean, rstd


@register_op("fused_bn_act_grad", "backward of fused_bn_act and fused_bn_add_act: dx, dweight, dbias, dresidual",
             kernels={"cuda": "fleetc.codegen.triton.norm:fused_bn_act_grad"},
             kernel_sources="fleetc.codegen.triton.norm:fused_bn_sources",
             cpu_kernel="fleetc.codegen.cpu.norm:plan_bn_act_grad")
def fused_bn_act_grad(dout: torch.Tensor, saved: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None, save_mean: torch.Tensor | None,
                      save_rstd: torch.Tensor | None, training: bool, eps: float, output_mask: list, act: str,
                      param: Any) -> tuple[torch.Tensor, ...]:
    """aten: `dpre = <act>_backward(dout, saved); dx, dw, db = native_batch_norm_backward(dpre, x, w, rm, rv, mean,
    rstd, training, eps, output_mask)`.

    Returns (dx, dw, db, dpre); `dpre` is the residual's gradient for fused_bn_add_act.
    """
    dpre = apply_grad(act, dout, saved, param)
    dx, dw, db = aten.native_batch_norm_backward.default(dpre, x, weight, running_mean, running_var, save_mean, save_rstd,
                                                 training, eps, output_mask)
    return dx, dw, db, dpre
