"""Ops on fleetc-owned state carried across steps: accumulators, cyclic step counters and latched flags."""
from __future__ import annotations

import torch

from fleetc.ir.registry import register_op


@register_op("accumulate", "add a freshly computed value into a persistable accumulator, in place")
def accumulate(acc: torch.Tensor, value: torch.Tensor) -> None:
    acc.add_(value)


@register_op("divide", "divide a persistable by a constant, in place (e.g. a merged gradient by k to average it)")
def divide(value: torch.Tensor, divisor: float) -> None:
    value.div_(divisor)


@register_op("zero", "reset a persistable to zero (False for flags), in place")
def zero(value: torch.Tensor) -> None:
    value.zero_()


@register_op("advance_cycle", "counter ← (counter + 1) mod period, in place; it reads 0 when a cycle completes")
def advance_cycle(counter: torch.Tensor, period: int) -> None:
    counter.add_(1).remainder_(period)


@register_op("latch", "set a persistable flag once a host signal is True; it stays set until zeroed")
def latch(flag: torch.Tensor, signal: bool) -> None:
    if signal:
        flag.fill_(True)
