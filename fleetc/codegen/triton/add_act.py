"""Triton kernels of `fleetc.fused_elemwise_add_act` and its gradient, written as `fused_elementwise` step lists.

No second code generator: each op becomes the aten steps its reference runs (add.Tensor and the
activation's own op, with the argument conventions of fleetc/ops/activations.py), and those steps
go through the `fused_elementwise` generator and launcher. The kernel runs from the op's arguments
alone (the reference's signature carries no op name), so a kernel's name is a function of what it
computes: `fused_add_gelu`, `fused_gelu_add` (act_first), `fused_add_gelu_tanh_grad`; the source hash
tells specialisations (dtypes, rank) apart on disk and in `dump-ir --kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fleetc.codegen.triton.kernel import KernelSource, generate_kernel
from fleetc.codegen.triton.launch import run_fused_elementwise
from fleetc.ir.program import Op, Var
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


def _run(launch: Launch, tensors: list[torch.Tensor]) -> Any:
    return run_fused_elementwise(*(tensors[i] for i in launch.inputs), steps=launch.steps,
                                 results=launch.results, name=launch.name)


def fused_elemwise_add_act(x: torch.Tensor, y: torch.Tensor, act_first: bool, act: str,
                           param: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of `fleetc.fused_elemwise_add_act`: (out, inter), as the reference returns them."""
    launches = forward_launches(tuple(x.shape), tuple(y.shape), act_first, act, param)
    if len(launches) == 1:
        return _run(launches[0], [x, y])
    return _run(launches[0], [x, y]), _run(launches[1], [x, y])


def fused_elemwise_add_act_grad(dout: torch.Tensor, saved: torch.Tensor | None, act: str, param: Any) -> torch.Tensor:
    """The Triton path of `fleetc.fused_elemwise_add_act_grad`."""
    return _run(grad_launch(saved is not None, act, param), [dout, saved])


def _sources(launches: list[Launch], specs: list[tuple[tuple, str]]) -> list[KernelSource]:
    """The launches' sources for tensors of these (shape, dtype) specs."""
    kernels = []
    for launch in launches:
        used = [specs[i] for i in launch.inputs]
        rank = len(torch.broadcast_shapes(*(shape for shape, _ in used)))
        kernels.append(generate_kernel(launch.name, launch.steps, launch.results, tuple(d for _, d in used), rank))
    return kernels


def add_act_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The kernels of one `fleetc.fused_elemwise_add_act` op, for `dump-ir --kernels`."""
    x, y = ((tuple(v.shape), v.dtype) for v in inputs[:2])
    act_first, act, param = op.args[2], op.args[3], op.args[4]
    return _sources(forward_launches(x[0], y[0], act_first, act, param), [x, y])


def add_act_grad_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The kernel of one `fleetc.fused_elemwise_add_act_grad` op, for `dump-ir --kernels`."""
    specs = [(tuple(v.shape), v.dtype) for v in inputs[:2] if v is not None]
    return _sources([grad_launch(len(specs) == 2, op.args[2], op.args[3])], specs)
