"""Lifted tensor constants: tensors a forward creates from Python data (`torch.tensor([...])`, a cached mask, a
lookup table), which torch.export lifts out of the graph.

A constant is a Var of kind CONSTANT; its value lives in `program.metadata["constants"][name]` as nested Python
numbers, so the printed text and the JSON round trip carry it with no format of their own, the verifier can check
that every CONSTANT Var has a value of its declared shape, and dead-code elimination drops the ones nothing reads.
"""
from __future__ import annotations

import torch

from fleetc.ir.program import Program, Var, VarKind

CONSTANTS_KEY = "constants"
_DTYPES_AS_NUMBERS = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                                "float64"})


def add_constant(program: Program, name: str, value: torch.Tensor) -> Var:
    """Declare `value` as the constant `name` of the global block (a real tensor; its values are copied)."""
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in _DTYPES_AS_NUMBERS:
        raise TypeError(f"a lifted constant of dtype {dtype} is not supported (only real and bool dtypes)")
    var = program.global_block.add_var(Var(name, tuple(int(d) for d in value.shape), dtype, str(value.device),
                                           VarKind.CONSTANT))
    program.metadata.setdefault(CONSTANTS_KEY, {})[name] = value.detach().cpu().tolist()
    return var


def constant_value(program: Program, var: Var) -> torch.Tensor:
    """The tensor behind the CONSTANT Var `var`, on its declared device."""
    values = program.metadata.get(CONSTANTS_KEY, {})[var.name]
    return torch.tensor(values, dtype=var.torch_dtype, device=var.device).reshape(var.shape)


def constant_problem(program: Program) -> str | None:
    """Why the constants are inconsistent (a CONSTANT Var with no value or a value of another shape, a value
    with no Var), or None."""
    values = program.metadata.get(CONSTANTS_KEY, {})
    declared = {v.name: v for v in program.all_vars() if v.kind is VarKind.CONSTANT}
    for name, var in declared.items():
        if name not in values:
            return f"constant {name!r} has no value in metadata[{CONSTANTS_KEY!r}]"
        shape = tuple(torch.tensor(values[name], dtype=var.torch_dtype).shape)
        if shape != tuple(var.shape or ()):
            return f"constant {name!r} is declared {list(var.shape or ())} but its value is {list(shape)}"
    extra = sorted(set(values) - set(declared))
    return f"metadata[{CONSTANTS_KEY!r}] holds values of undeclared constants {extra}" if extra else None


def drop_unused_constants(program: Program, used: set[str]) -> int:
    """Forget CONSTANT Vars (and their values) that no op reads and no fetch names; returns how many."""
    values = program.metadata.get(CONSTANTS_KEY, {})
    dropped = 0
    for block in program.blocks:
        for name in [n for n, v in block.vars.items() if v.kind is VarKind.CONSTANT and n not in used]:
            del block.vars[name]
            values.pop(name, None)
            dropped += 1
    if not values:
        program.metadata.pop(CONSTANTS_KEY, None)
    return dropped
