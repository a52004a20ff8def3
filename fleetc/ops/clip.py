"""Gradient clipping ops with Paddle's semantics: by global norm, by each gradient's norm, by value.

Paddle scales by `clip_norm / max(norm, clip_norm)`, so gradients within the limit are untouched and
the others end with exactly norm `clip_norm`. (`torch.nn.utils.clip_grad_norm_` scales by
`max_norm / (norm + 1e-6)` clamped to 1: a relative difference of about 1e-6 / norm.) Norms are
accumulated in float32 (float64 for float64 gradients). Every op returns new gradient tensors.
"""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


def _accumulation_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def _one_or_tuple(grads: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return grads[0] if len(grads) == 1 else tuple(grads)


@register_op("squared_global_norm", "sum of the squares of all gradients' elements (the global norm, squared)")
def squared_global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """A separate op so that sharded or pipelined Programs can sum it across ranks before the square root."""
    dtype = _accumulation_dtype(grads)
    if not grads:  # a sharding rank that keeps no gradient: its share of the norm
        return torch.zeros((), dtype=dtype)
    norms = torch._foreach_norm([g.to(dtype) for g in grads])
    return torch.stack(norms).square().sum()


@register_op("clip_by_global_norm", "scale all gradients by clip_norm / max(global_norm, clip_norm)")
def clip_by_global_norm(grads: list[torch.Tensor], squared_norm: torch.Tensor,
                        clip_norm: float) -> torch.Tensor | tuple[torch.Tensor, ...]:
    scale = clip_norm / torch.clamp_min(squared_norm.sqrt(), clip_norm)
    return _one_or_tuple([g * scale.to(g.dtype) for g in grads])


@register_op("clip_by_norm", "scale each gradient by clip_norm / max(its norm, clip_norm)")
def clip_by_norm(grads: list[torch.Tensor], clip_norm: float) -> torch.Tensor | tuple[torch.Tensor, ...]:
    dtype = _accumulation_dtype(grads)
    norms = torch._foreach_norm([g.to(dtype) for g in grads])
    return _one_or_tuple([g * (clip_norm / torch.clamp_min(n, clip_norm)).to(g.dtype) for g, n in zip(grads, norms)])


@register_op("clip_by_value", "clamp every gradient element into [min, max]")
def clip_by_value(grads: list[torch.Tensor], min_value: float, max_value: float) -> torch.Tensor | tuple:
    return _one_or_tuple([g.clamp(min_value, max_value) for g in grads])
