"""Multi-tensor optimizer updates: one op updates a whole group of parameters with torch's `_foreach_*` kernels.

The arithmetic is torch.optim's single-tensor update, op for op, so a fused update is bit-identical to
eager torch.optim on CPU (torch's `_fused_adam_` rounds differently, and Adam turns the rounding noise on a
parameter whose true gradient is zero, such as an attention key bias, into lr-sized steps). The Adam
step counters stay tensors, read back once per group rather than with one `step.item()` per parameter.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("fused_sgd", "SGD (momentum, dampening, nesterov, weight decay) for a list of parameters at once",
             cpu_kernel="fleetc.codegen.cpu.optimizer:plan_fused_sgd")
def fused_sgd(params: list, grads: list, momentum_buffers: list | None, fresh: list, lr: float, momentum: float,
              dampening: float, nesterov: bool, weight_decay: float, maximize: bool) -> None:
    """aten, per parameter (as fleetc.sgd): `g = -g` (maximize); `g = g + wd * p`; `buf = g` (fresh) or
    `buf = momentum * buf + (1 - dampening) * g`; `g = g + momentum * buf` (nesterov) or `g = buf`; `p -= lr * g`."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        new = [i for i, is_fresh in enumerate(fresh) if is_fresh]
        old = [i for i, is_fresh in enumerate(fresh) if not is_fresh]
        if new:
            torch._foreach_copy_([momentum_buffers[i] for i in new], [grads[i] for i in new])
        if old:
            old_buffers = [momentum_buffers[i] for i in old]
            torch._foreach_mul_(old_buffers, momentum)
            torch._foreach_add_(old_buffers, [grads[i] for i in old], alpha=1 - dampening)
        grads = torch._foreach_add(grads, momentum_buffers, alpha=momentum) if nesterov else momentum_buffers
    torch._foreach_add_(params, grads, alpha=-lr)


@register_op("fused_adam", "Adam / AdamW for a list of parameters at once",
             cpu_kernel="fleetc.codegen.cpu.optimizer:plan_fused_adam")
def fused_adam(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool, maximize: bool) -> None:
    """aten, per parameter (as fleetc.adam): `step += 1`; weight decay (decoupled: `p *= 1 - lr * wd`, else
    `g += wd * p`); `m = lerp(m, g, 1 - beta1)`; `v = beta2 * v + (1 - beta2) * g * g`;
    `p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)`."""
    if maximize:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_values = torch.stack(steps).tolist()  # one read-back for the whole group
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [(1 - beta2**s) ** 0.5 for s in step_values])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1**s) for s in step_values])
