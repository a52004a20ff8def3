"""Layer-wise adaptive updates with Paddle's rules: LARS momentum (You et al. 2017) and LAMB (You et al. 2019).

Each per-parameter op is its multi-tensor op on one-element lists, so fused and unfused updates are
bit-identical. The per-parameter trust ratios are computed with `_foreach_norm` and read back once
per group (one host synchronisation, as the fused Adam's step counts).

Where Paddle and the papers differ, fleetc follows Paddle's kernels (checked against Paddle 3.3.1):
- LARS: the layer-wise rate `lr * lars_coeff * ||p|| / (||g|| + lars_weight_decay * ||p|| + epsilon)`
  applies only when `lars_weight_decay > 0` and both norms are positive; otherwise (a parameter
  excluded from weight decay, a zero parameter) the rate is `lr`, a plain momentum step. The paper
  adapts every layer.
- LAMB: the trust ratio `||p|| / ||r||` applies only when the parameter's weight decay is > 0
  (Paddle's `always_adapt=False`) and both norms are positive; otherwise it is 1, an Adam step
  without weight decay. The paper adapts every layer.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("fused_lars_momentum", "LARS momentum (Paddle's lars_momentum) for a list of parameters at once")
def fused_lars_momentum(params: list, grads: list, velocities: list, lars_weight_decays: list, lr: float,
                        momentum: float, weight_decay: float, maximize: bool, lars_coeff: float,
                        epsilon: float) -> None:
    """aten, per parameter: `g = -g` (maximize); `g += weight_decay * p` (the SGD's own decay, as Paddle's
    regularizer); `rate = lr * lars_coeff * |p| / (|g| + wd * |p| + epsilon)` if wd > 0 and |p|, |g| > 0, else lr;
    `v = momentum * v + rate * (g + wd * p)`; `p -= v` (wd: the parameter's lars_weight_decay)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    p_norms = torch.stack(torch._foreach_norm(params))
    g_norms = torch.stack(torch._foreach_norm(grads))
    decays = torch.tensor(lars_weight_decays, dtype=p_norms.dtype, device=p_norms.device)
    adapted = lr * lars_coeff * p_norms / (g_norms + decays * p_norms + epsilon)
    rates = torch.where((decays > 0) & (p_norms > 0) & (g_norms > 0), adapted, torch.full_like(adapted, lr)).tolist()
    steps = torch._foreach_add(grads, torch._foreach_mul(params, lars_weight_decays))
    torch._foreach_mul_(steps, rates)
    torch._foreach_mul_(velocities, momentum)
    torch._foreach_add_(velocities, steps)
    torch._foreach_sub_(params, velocities)


@register_op("lars_momentum", "LARS momentum (Paddle's lars_momentum) for one parameter")
def lars_momentum(param: torch.Tensor, grad: torch.Tensor, velocity: torch.Tensor, lars_weight_decay: float,
                  lr: float, momentum: float, weight_decay: float, maximize: bool, lars_coeff: float,
                  epsilon: float) -> None:
    """fleetc.fused_lars_momentum on one parameter."""
    fused_lars_momentum([param], [grad], [velocity], [lars_weight_decay], lr, momentum, weight_decay, maximize,
                        lars_coeff, epsilon)


@register_op("fused_lamb", "LAMB (Paddle's lamb) for a list of parameters at once")
def fused_lamb(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, lamb_weight_decays: list,
               lr: float, beta1: float, beta2: float, eps: float, maximize: bool) -> None:
    """aten, per parameter: `g = -g` (maximize); `step += 1`; `m = lerp(m, g, 1 - beta1)`;
    `v = beta2 * v + (1 - beta2) * g * g`; `r = (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    + wd * p`; `ratio = |p| / |r|` if wd > 0 and |p|, |r| > 0, else 1; `p -= lr * ratio * r`
    (wd: the parameter's lamb_weight_decay)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(steps, 1)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_values = torch.stack(steps).tolist()  # one read-back for the whole group
    m_hat = torch._foreach_div(exp_avgs, [1 - beta1**s for s in step_values])
    v_hat = torch._foreach_div(exp_avg_sqs, [1 - beta2**s for s in step_values])
    denoms = torch._foreach_sqrt(v_hat)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(m_hat, denoms)
    torch._foreach_add_(updates, torch._foreach_mul(params, lamb_weight_decays))
    p_norms = torch.stack(torch._foreach_norm(params))
    r_norms = torch.stack(torch._foreach_norm(updates))
    decays = torch.tensor(lamb_weight_decays, dtype=p_norms.dtype, device=p_norms.device)
    ratios = torch.where((decays > 0) & (p_norms > 0) & (r_norms > 0), p_norms / r_norms, torch.ones_like(p_norms))
    torch._foreach_mul_(updates, (-lr * ratios).tolist())
    torch._foreach_add_(params, updates)


@register_op("lamb", "LAMB (Paddle's lamb) for one parameter")
def lamb(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         step: torch.Tensor, lamb_weight_decay: float, lr: float, beta1: float, beta2: float, eps: float,
         maximize: bool) -> None:
    """fleetc.fused_lamb on one parameter."""
    fused_lamb([param], [grad], [exp_avg], [exp_avg_sq], [step], [lamb_weight_decay], lr, beta1, beta2, eps, maximize)
