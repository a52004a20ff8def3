"""Host-scalar arithmetic ops: the Python math a traced optimizer update does on its hyperparameters.

Tracing torch.optim's step with symbolic hyperparameters records `1 - beta1`, `-lr`, `lr * weight_decay`
as Python operator calls on scalars; these ops carry them into the Program, so the values are
computed from the fed hyperparameters every step instead of being baked in as constants.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from fleetc.ir.registry import register_op

# Python function a traced graph calls → fleetc op name (`fleetc.<name>`).
SCALAR_OPS: dict[Callable, str] = {
    operator.add: "scalar_add",
    operator.sub: "scalar_sub",
    operator.mul: "scalar_mul",
    operator.truediv: "scalar_truediv",
    operator.floordiv: "scalar_floordiv",
    operator.mod: "scalar_mod",
    operator.pow: "scalar_pow",
    operator.neg: "scalar_neg",
    math.sqrt: "scalar_sqrt",
    torch.sym_float: "scalar_float",
    torch.sym_sqrt: "scalar_sqrt",
    torch.sym_max: "scalar_max",
    torch.sym_min: "scalar_min",
}

_REFERENCES: dict[str, tuple[Callable, str]] = {
    "scalar_add": (operator.add, "a + b on host scalars"),
    "scalar_sub": (operator.sub, "a - b on host scalars"),
    "scalar_mul": (operator.mul, "a * b on host scalars"),
    "scalar_truediv": (operator.truediv, "a / b on host scalars"),
    "scalar_floordiv": (operator.floordiv, "a // b on host scalars"),
    "scalar_mod": (operator.mod, "a % b on host scalars"),
    "scalar_pow": (operator.pow, "a ** b on host scalars"),
    "scalar_neg": (operator.neg, "-a on a host scalar"),
    "scalar_sqrt": (math.sqrt, "square root of a host scalar"),
    "scalar_float": (float, "a host scalar as a Python float"),
    "scalar_max": (max, "the larger of two host scalars"),
    "scalar_min": (min, "the smaller of two host scalars"),
}


def _register(name: str, fn: Callable, summary: str) -> None:
    def reference(*args: Any) -> Any:
        return fn(*args)

    reference.__doc__ = summary
    register_op(name, summary)(reference)


for _name, (_fn, _summary) in _REFERENCES.items():
    _register(_name, _fn, _summary)


@register_op("item", "a one-element tensor as a host scalar (a traced update passing a tensor where torch wants a number)")
def item(value: torch.Tensor) -> float | int | bool:
    return value.item()
