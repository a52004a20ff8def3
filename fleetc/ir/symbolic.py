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
