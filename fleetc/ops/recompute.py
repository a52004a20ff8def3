"""Ops the recompute pass emits: replaying a recorded dropout from its saved mask."""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("dropout_replay", "native_dropout's output again from its saved mask: x * mask * scale, no new draw")
def dropout_replay(x: torch.Tensor, mask: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    if train is False:
        return x.clone()
    p1m = 1.0 - p
    if x.is_cuda and 0.0 < p < 1.0 and x.numel() > 0:
        # aten's fused CUDA dropout kernel: x * mask * scale in float32 (scale = 1 / float32(1 - p)),
        # rounded to x's dtype once at the end.
        scale = float(torch.tensor(1.0 / float(torch.tensor(p1m, dtype=torch.float32)), dtype=torch.float32))
        return (x.float() * mask * scale).to(x.dtype)
    # aten's CPU (and non-fused) path: the scale is rounded to x's dtype before the multiply. In float32 this is
    # x * mask * float32(scale); in bf16/fp16 the scale is a bf16/fp16 number, so multiplying in float32 with the
    # exact scale (what a plain x.mul(mask).mul_(scale) does) differs on about a quarter of the elements.
    scale = mask.to(x.dtype).mul_(0.0 if p1m == 0 else 1.0 / p1m)
    return x.mul(scale)
