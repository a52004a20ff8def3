"""Ops the recompute pass emits: replaying a recorded dropout from its saved mask."""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("dropout_replay", "native_dropout's output again from its saved mask: x * mask * scale, no new draw")
def dropout_replay(x: torch.Tensor, mask: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    if train is False:
        return x.clone()
    # The same expression, in the same order, as aten::native_dropout on CPU, so results are bit-identical.
    p1m = 1.0 - p
    return x.mul(mask).mul_(0.0 if p1m == 0 else 1.0 / p1m)
