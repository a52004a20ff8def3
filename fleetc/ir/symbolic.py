"""Symbolic sizes: Var shapes of a dynamic Program hold sympy expressions in its dim names (`batch`, `seq*4`).

These helpers evaluate them at concrete sizes and build byte counts as formulas; `Program.metadata["dynamic"]`
(fleetc/capture/dynamic.py) holds each symbol's range and the sizes it was traced with (`hints`).
"""
from __future__ import annotations

from typing import Any

import sympy
import torch


def is_symbolic(shape: tuple | None) -> bool:
    return shape is not None and not all(isinstance(d, int) for d in shape)


def sym_value(expr: Any, values: dict[str, int]) -> int:
    """An int dim, or a symbolic one evaluated at `values` (symbol name → size)."""
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace({s: values[s.name] for s in expr.free_symbols}))


def sym_nbytes(shape: tuple | None, dtype: str) -> int | sympy.Expr:
    """Bytes of a value of this shape: an int, or a formula in the dims (0 for a host scalar)."""
    if shape is None:
        return 0
    numel: Any = 1
    for d in shape:
        numel = numel * d
    size = numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return int(size) if isinstance(size, int) or getattr(size, "is_Integer", False) else sympy.expand(size)


def hints(program: Any) -> dict[str, int]:
    """The sizes a dynamic Program was traced with (empty for a static one)."""
    return program.metadata.get("dynamic", {}).get("hints", {})


def concrete_shape(shape: tuple, sizes: dict[str, int]) -> tuple[int, ...]:
    """A Var shape with its symbolic dims evaluated at `sizes` (fake tensors need ints)."""
    return tuple(sym_value(d, sizes) for d in shape)


def traced_sizes(program: Any) -> dict[str, int]:
    """The values a dynamic Program's size ops (`aten.sym_size.int`, `fleetc.scalar_*` on sizes) compute at its
    traced sizes, by Var name: what a pass that runs ops on fake tensors (AMP's dtype inference) feeds them."""
    from fleetc.ir.program import Ref
    from fleetc.ir.registry import resolve_callable

    sizes, values = hints(program), {}
    if not sizes:
        return values
    for op in program.global_block.ops:
        if op.type == "aten.sym_size.int" and isinstance(op.args[0], Ref):
            shape = program.var(op.args[0].name).shape
            values[op.outputs[0]] = sym_value(shape[op.args[1]], sizes)
        elif op.type.startswith("fleetc.scalar_") and all(not isinstance(a, Ref) or a.name in values
                                                          for a in op.args):
            args = [values[a.name] if isinstance(a, Ref) else a for a in op.args]
            values[op.outputs[0]] = resolve_callable(op.type)(*args)
    return values
