"""Triton kernels for fleetc's fused ops: source generation, on-disk cache, launch on CUDA tensors.

Which op types have kernels is declared where each op is registered (`register_op(..., kernels=...,
kernel_sources=...)` in fleetc/ops/); this package lists their sources for `dump-ir --kernels`.
"""
from __future__ import annotations

import torch

from fleetc.codegen.triton.kernel import KernelSource, generate_kernel
from fleetc.ir.program import Op, Program, Ref, Var
from fleetc.ir.registry import import_target, registered_ops


def fused_elementwise_sources(op: Op, inputs: list[Var | None]) -> list[KernelSource]:
    """The one kernel of a `fleetc.fused_elementwise` op (shapes and dtypes from its input Vars).

    Every `kernel_sources` lister takes the op and, per positional argument, its Var (None for a non-tensor).
    """
    rank = len(torch.broadcast_shapes(*(tuple(v.shape) for v in inputs)))
    return [generate_kernel(op.kwargs["name"], op.kwargs["steps"], op.kwargs["results"],
                            tuple(v.dtype for v in inputs), rank)]


def program_kernels(program: Program) -> list[KernelSource]:
    """The kernel sources of every op with generated kernels, in program order (shapes and dtypes from its Vars)."""
    listers = {name: d.kernel_sources for name, d in registered_ops().items() if d.kernel_sources}
    kernels = []
    for block, op in program.walk_ops():
        if op.type in listers:
            inputs = [program.var(a.name, block.idx) if isinstance(a, Ref) else None for a in op.args]
            kernels += import_target(listers[op.type])(op, inputs)
    return kernels


def format_kernels(program: Program) -> str:
    """Every generated kernel source under a header with its name and source hash (for `dump-ir --kernels`)."""
    kernels = program_kernels(program)
    if not kernels:
        return "# no generated kernels: the Program has no fused op with a Triton kernel (enable a fusion flag)\n"
    return "\n".join(f"# kernel {k.name}  source sha256:{k.source_hash}\n{k.source}" for k in kernels)
