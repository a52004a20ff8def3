"""Triton kernels of `fleetc.fused_elemwise_add_act` and its gradient, written as `fused_elementwise` step lists.

No second code generator: each op becomes the aten steps its reference runs (add_act_steps.py, shared
with the CPU backend), and those steps go through the `fused_elementwise` generator and launcher.
"""
from __future__ import annotations

from typing import Any

import torch

from fleetc.codegen.add_act_steps import Launch, forward_launches, grad_launch
from fleetc.codegen.triton.kernel import KernelSource, generate_kernel
from fleetc.codegen.triton.launch import run_fused_elementwise
from fleetc.ir.program import Op, Var


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
