"""Loss-scaling ops for mixed precision: scale the backward seed, check and unscale gradients, adapt the scale.

The scale and its good/bad step counters are persistable counters; the ops update them in place
with tensor arithmetic (no host synchronisation), following Paddle's `update_loss_scaling`.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("scale_loss_grad", "backward seed times the loss scale; a zero scale (no step run yet) starts at init")
def scale_loss_grad(seed: torch.Tensor, loss_scaling: torch.Tensor, init_loss_scaling: float) -> tuple[torch.Tensor]:
    start_loss_scaling(loss_scaling, init_loss_scaling)
    return (seed * loss_scaling,)


@register_op("start_loss_scaling", "set a zero loss scale (no step run yet) to its initial value")
def start_loss_scaling(loss_scaling: torch.Tensor, init_loss_scaling: float) -> None:
    """Counters start zero-filled and a live scale is never below 1, so zero means "first step". A pipeline stage
    without the loss (whose backward seed scaling does this) runs it before unscaling its gradients."""
    loss_scaling.copy_(torch.where(loss_scaling == 0, init_loss_scaling, loss_scaling))


@register_op("check_finite_and_unscale", "divide all gradients by the loss scale and flag any inf/nan, in one op")
def check_finite_and_unscale(grads: list[torch.Tensor], loss_scaling: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Returns the unscaled gradients (the input tensors, updated in place) and found_inf (1.0 on overflow)."""
    seen: set[int] = set()
    for i, grad in enumerate(grads):  # gradients that are views of one storage must not be unscaled twice
        storage = grad.untyped_storage().data_ptr()
        if storage in seen:
            grads[i] = grad.clone()
        seen.add(grads[i].untyped_storage().data_ptr())
    found_inf = torch.zeros(1, dtype=torch.float32, device=loss_scaling.device)
    inv_scale = loss_scaling.double().reciprocal().float().reshape(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return (*grads, found_inf)


@register_op("update_loss_scaling", "Paddle's dynamic loss-scaling rule: shrink after overflows, grow after clean runs")
def update_loss_scaling(found_inf: torch.Tensor, loss_scaling: torch.Tensor, num_good_steps: torch.Tensor,
                        num_bad_steps: torch.Tensor, incr_every_n_steps: int, decr_every_n_nan_or_inf: int,
                        incr_ratio: float, decr_ratio: float) -> None:
    """Overflow: good = 0, bad += 1, and at `decr_every_n_nan_or_inf` bad steps scale = max(1, scale × decr_ratio),
    bad = 0. Clean: bad = 0, good += 1, and at `incr_every_n_steps` good steps scale × incr_ratio (kept only
    if finite), good = 0."""
    overflow = found_inf.reshape(()) > 0
    bad = torch.where(overflow, num_bad_steps + 1, 0)
    good = torch.where(overflow, 0, num_good_steps + 1)
    shrink = overflow & (bad == decr_every_n_nan_or_inf)
    grow = ~overflow & (good == incr_every_n_steps)
    shrunk = (loss_scaling * decr_ratio).clamp_min(1.0)
    grown = loss_scaling * incr_ratio
    grown = torch.where(torch.isfinite(grown), grown, loss_scaling)
    loss_scaling.copy_(torch.where(shrink, shrunk, torch.where(grow, grown, loss_scaling)))
    num_bad_steps.copy_(torch.where(shrink, 0, bad))
    num_good_steps.copy_(torch.where(grow, 0, good))
