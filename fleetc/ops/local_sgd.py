"""Local SGD's schedule ops: when to average the parameters, and adaptive local SGD's interval rule.

Counters are persistable int64 / float32 tensors updated in place (zero-filled before the first step);
the decisions are bool tensors a `fleetc.conditional_block` reads.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op

# Paddle's bounds on the adapted interval.
MIN_LOCAL_STEPS, MAX_LOCAL_STEPS = 1, 16


@register_op("local_sgd_due", "whether this step averages the parameters: every step up to begin_step, "
             "then when k_steps steps have passed since the last average")
def local_sgd_due(step: torch.Tensor, last_step: torch.Tensor, k_steps: torch.Tensor | int,
                  begin_step: int) -> torch.Tensor:
    return (step <= begin_step) | (step - last_step == k_steps)


@register_op("adaptive_local_sgd_start", "adaptive local SGD's first step: remember the averaged loss and the lr, "
             "start the interval at init_k_steps")
def adaptive_local_sgd_start(loss_0: torch.Tensor, lr_0: torch.Tensor, k_steps: torch.Tensor,
                             avg_loss: torch.Tensor, lr: float, init_k_steps: int) -> None:
    loss_0.copy_(avg_loss)
    lr_0.fill_(lr)
    k_steps.fill_(init_k_steps)


@register_op("adapt_local_steps", "adaptive local SGD's interval: ceil(sqrt(lr_0 * loss / (lr * loss_0) * "
             "init_k_steps)), clamped to [1, 16] (Wang & Joshi, as Paddle computes it)")
def adapt_local_steps(k_steps: torch.Tensor, lr_0: torch.Tensor, loss_0: torch.Tensor, avg_loss: torch.Tensor,
                      lr: float, init_k_steps: int) -> None:
    ratio = lr_0 * avg_loss / (lr * loss_0) * float(init_k_steps)
    k_steps.copy_(torch.ceil(torch.sqrt(ratio)).to(k_steps.dtype).clamp(MIN_LOCAL_STEPS, MAX_LOCAL_STEPS))


@register_op("increment", "counter ← counter + 1, in place")
def increment(counter: torch.Tensor) -> None:
    counter.add_(1)
