"""`fleetc.fused_elemwise_add_act` and its gradient as `fused_elementwise` step lists, for every backend.

No second code generator: each op becomes the aten steps its reference runs (add.Tensor and the
activation's own op, with the argument conventions of fleetc/ops/activations.py), and those steps go
through a backend's `fused_elementwise` generator. The kernel runs from the op's arguments alone (the
reference's signature carries no op name), so a kernel's name is a function of what it computes:
`fused_add_gelu`, `fused_gelu_add` (act_first), `fused_add_gelu_tanh_grad`; the source hash tells
specialisations (dtypes, rank) apart on disk and in `dump-ir --kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fleetc.ops.activations import activation_call, activation_grad_call
from fleetc.ops.fused_elementwise import operand

_ADD = "aten.add.Tensor"


@dataclass(frozen=True)
class Launch:
    """One generated kernel of a fused op: its steps over the op's tensor arguments picked by `inputs`."""

    name: str
    steps: tuple
    results: tuple
    inputs: tuple[int, ...]  # which of the op's tensor arguments the kernel reads


def _act_tag(act: str, param: Any) -> str:
    return f"{act}_tanh" if act == "gelu" and param == "tanh" else act


def forward_launches(x_shape: tuple, y_shape: tuple, act_first: bool, act: str, param: Any) -> list[Launch]:
    """The kernels of `fused_elemwise_add_act` for addends of these shapes; results are (out, inter).

    One kernel stores both results whenever `inter` has the output's shape. With act_first and a
    broadcast `y` (x + act(bias)), `inter = act(y)` is smaller than the output, so a small kernel over
    y's shape stores it and the main kernel recomputes act(y) in fp32 (one rounding, as on the other path).
    """
    x, y = operand(0), operand(1)
    if not act_first:
        name = f"fused_add_{_act_tag(act, param)}"
        return [Launch(name, ((_ADD, (x, y), ()), activation_call(act, operand(2), param)), (3, 2), (0, 1))]
    name = f"fused_{_act_tag(act, param)}_add"
    steps = (activation_call(act, y, param), (_ADD, (x, operand(2)), ()))
    if tuple(y_shape) == tuple(torch.broadcast_shapes(x_shape, y_shape)):
        return [Launch(name, steps, (3, 2), (0, 1))]
    return [Launch(name, steps, (3,), (0, 1)),
            Launch(f"{name}_inter", (activation_call(act, operand(0), param),), (1,), (1,))]


def grad_launch(has_saved: bool, act: str, param: Any) -> Launch:
    """The one kernel of `fused_elemwise_add_act_grad` (scale's gradient reads no saved value)."""
    step = activation_grad_call(act, operand(0), operand(1) if has_saved else None, param)
    inputs = (0, 1) if has_saved else (0,)
    return Launch(f"fused_add_{_act_tag(act, param)}_grad", (step,), (len(inputs),), inputs)
