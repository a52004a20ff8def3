"""Ops that write persistable state: buffer updates captured from the model (e.g. BatchNorm stats)."""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("assign", "copy a freshly computed value into a persistable Var, in place")
def assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
