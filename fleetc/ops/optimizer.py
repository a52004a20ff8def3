"""Per-parameter optimizer updates (role optimize), matching torch.optim's single-tensor code paths.

Each op updates the parameter and its state tensors in place; hyperparameters arrive as host scalars
fed every step (or the constant 0.0 when zero), the on/off options (nesterov, maximize) as constants.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op

# optimizer.state key of the float32 master copy of a low-precision parameter (amp use_pure_fp16).
MASTER_KEY = "master_weight"


@register_op("sgd", "SGD step with optional weight decay, momentum, dampening and nesterov")
def sgd(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    fresh: bool,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
) -> None:
    """`fresh` says the momentum buffer holds no history yet: torch then starts it at the gradient."""
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if fresh:
            momentum_buffer.copy_(grad)
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)


@register_op("adam", "Adam / AdamW step (decoupled weight decay for AdamW), bias-corrected")
def adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    if maximize:
        grad = -grad
    step += 1
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_value = step.item()
    bias_correction1 = 1 - beta1**step_value
    bias_correction2_sqrt = (1 - beta2**step_value) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
