"""Python int arguments traced as symbolic sizes, so an int that changes every call does not recompile every value.

torch.export traces a tensor's sizes symbolically but bakes ints in. An int argument the dynamic policy marks (it
changed since the step kind's first call, fleetc/runtime/dynamic_policy.py) is therefore fed as a *size carrier*:
an empty tensor of shape (n, 0) whose dim 0 is traced as a symbol named after the argument; the step module hands
the model `carrier.size(0)`, a SymInt, where the int was. Carriers come after the real tensors among a step's
tensor inputs, so marking one never moves the others' positions (which the dynamic dims are keyed by). Only ints
>= 0 are carried (sizes are); a bool, a negative int or any other value stays a constant of the Program.
"""
from __future__ import annotations

from typing import Any

import torch

_CARRIER_ATTR = "_fleetc_int_argument"


def is_size(value: Any) -> bool:
    """Whether `value` can be carried: a plain int >= 0 (not a bool)."""
    return type(value) is int and value >= 0


def size_carrier(value: int) -> torch.Tensor:
    """The empty tensor of shape (value, 0) that stands for the int argument `value`."""
    carrier = torch.empty((value, 0))
    setattr(carrier, _CARRIER_ATTR, True)
    return carrier


def is_carrier(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and getattr(leaf, _CARRIER_ATTR, False)


def tensor_positions(leaves: list) -> list[int]:
    """Which leaves of a step's (args, kwargs) the Program is fed, in feed order: the tensors, then the carriers."""
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return [i for i in tensors if not is_carrier(leaves[i])] + [i for i in tensors if is_carrier(leaves[i])]
