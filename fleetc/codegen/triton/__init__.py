"""Triton kernels for `fleetc.fused_elementwise` ops: source generation, on-disk cache, launch on CUDA tensors."""
from __future__ import annotations

import torch

from fleetc.codegen.triton.kernel import KernelSource, generate_kernel
from fleetc.ir.program import Program

FUSED_OP_TYPE = "fleetc.fused_elementwise"


def program_kernels(program: Program) -> list[KernelSource]:
    """The kernel source of every fused op in the Program, in program order (shapes and dtypes from its Vars)."""
    kernels = []
    for block, op in program.walk_ops():
        if op.type != FUSED_OP_TYPE:
            continue
        inputs = [program.var(ref.name, block.idx) for ref in op.args]
        rank = len(torch.broadcast_shapes(*(tuple(v.shape) for v in inputs)))
        kernels.append(generate_kernel(op.kwargs["name"], op.kwargs["steps"], op.kwargs["results"],
                                       tuple(v.dtype for v in inputs), rank))
    return kernels


def format_kernels(program: Program) -> str:
    """Every generated kernel source under a header with its name and source hash (for `dump-ir --kernels`)."""
    kernels = program_kernels(program)
    if not kernels:
        return "# no generated kernels: the Program has no fleetc.fused_elementwise op (enable_auto_fusion)\n"
    return "\n".join(f"# kernel {k.name}  source sha256:{k.source_hash}\n{k.source}" for k in kernels)
