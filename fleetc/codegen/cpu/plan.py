"""What the CPU backend makes of one op: its C++ kernels and how to run them once they are built.

Each fused op type declares a planner where it is registered (`register_op(..., cpu_kernel="module:function")`):
`planner(op, input Vars) -> CpuPlan`, or `Unsupported(reason)` when the op's dtypes or arguments have no kernel
(the op then runs its aten reference and the report says why). Planning only generates source; `bind` turns the
built kernel functions into a callable with the reference's signature.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fleetc.codegen.cpu.source import CppKernel
from fleetc.ir.program import Op, Var


class Unsupported(Exception):
    """An op the CPU backend leaves to its aten reference, with the reason."""


@dataclass(frozen=True)
class CpuPlan:
    """The kernels of one op and `bind(functions) -> callable(*args, **kwargs)` (functions in `kernels` order)."""

    kernels: tuple[CppKernel, ...]
    bind: Callable[[list[Any]], Callable[..., Any]]
    exact: bool = False  # bit-identical to the reference (fp32), not only within a stated tolerance


Planner = Callable[[Op, list[Var | None]], CpuPlan]

# torch dtype names (as Vars spell them) the kernels compute with
FLOAT_DTYPES = ("float32", "bfloat16")


def require_dtypes(what: str, dtypes: list[str], allowed: tuple[str, ...] = FLOAT_DTYPES) -> None:
    bad = sorted({d for d in dtypes if d not in allowed})
    if bad:
        raise Unsupported(f"{what}: dtype {', '.join(bad)} has no CPU kernel (supported: {', '.join(allowed)})")


def pointers(tensors: list[torch.Tensor | None], extra: tuple = ()) -> ctypes.Array:
    """The `data` argument of a kernel: each tensor's data pointer (NULL for None), then `extra` raw addresses."""
    values = [t.data_ptr() if t is not None else None for t in tensors] + list(extra)
    return (ctypes.c_void_p * len(values))(*values)


def int_array(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def float_array(values: list[float]) -> ctypes.Array:
    return (ctypes.c_double * max(1, len(values)))(*values)


def num_threads() -> int:
    """The thread count kernels use: torch's own, so kernels and aten ops never oversubscribe the cores."""
    return torch.get_num_threads()
