"""Eager references for gradient clipping: Paddle's formulas on `p.grad`, applied between backward() and step()."""
from __future__ import annotations

import torch

import fleetc


def clip_grads_(params, clip) -> None:
    """Clip the gradients of `params` in place as fleetc's `clip` (Paddle's rule) does."""
    grads = [p.grad for p in params if p.grad is not None]
    if isinstance(clip, fleetc.ClipGradByGlobalNorm):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = clip.clip_norm / torch.clamp_min(norm, clip.clip_norm)
        for g in grads:
            g.mul_(scale)
    elif isinstance(clip, fleetc.ClipGradByNorm):
        for g in grads:
            g.mul_(clip.clip_norm / torch.clamp_min(torch.linalg.vector_norm(g), clip.clip_norm))
    else:
        for g in grads:
            g.clamp_(clip.min, clip.max)
