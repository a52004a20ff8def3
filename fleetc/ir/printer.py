"""Deterministic text form of a Program: one op per line, `outputs = type(inputs) {attrs}  # role module source`."""
from __future__ import annotations

import os
from typing import Any

import torch

from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind

_DTYPE_SHORT = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
}
# Attributes printed in the trailing comment rather than inside braces.
STANDARD_ATTRS = ("op_role", "module_path", "source", "forward_op", "op_device", "provenance", "sub_block")


def format_type(var: Var) -> str:
    """`f32[8,16]` for tensors, `f64` for host scalars."""
    dtype = _DTYPE_SHORT.get(var.dtype, var.dtype)
    if var.shape is None:
        return dtype
    return f"{dtype}[{','.join(str(d) for d in var.shape)}]"


def format_value(value: Any) -> str:
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_op(op: Op, program: Program, block_idx: int = 0) -> str:
    """One line: outputs with types, the call, non-standard attrs, then role · module · source."""
    outs = []
    for name in op.outputs:
        if name is None:
            outs.append("_")
            continue
        var = program.find_var(name, block_idx)
        outs.append(f"{name}: {format_type(var)}" if var is not None else name)
    call_args = [format_value(a) for a in op.args] + [f"{k}={format_value(v)}" for k, v in op.kwargs.items()]
    line = f"{', '.join(outs) or '()'} = {op.type}({', '.join(call_args)})"
    extra = {k: v for k, v in op.attrs.items() if k not in STANDARD_ATTRS}
    if extra:
        line += " {" + ", ".join(f"{k}={format_value(v)}" for k, v in sorted(extra.items())) + "}"
    notes = [op.role.label()]
    if op.module_path:
        notes.append(op.module_path)
    for key in ("op_device", "forward_op", "provenance"):
        if op.attrs.get(key):
            notes.append(f"{key}={op.attrs[key]}")
    if op.attrs.get("source"):
        path, _, line_no = op.attrs["source"].rpartition(":")
        notes.append(f"{os.path.basename(path)}:{line_no}")
    return f"{line}  # {'  '.join(notes)}"


def _format_block(program: Program, block: Block, indent: str, lines: list[str]) -> None:
    persistables = sorted((v for v in block.vars.values() if v.kind is not VarKind.TEMP), key=lambda v: v.name)
    for var in persistables:
        lines.append(f"{indent}{var.kind.value} {var.name}: {format_type(var)} {var.device}")
    for op in block.ops:
        lines.append(indent + format_op(op, program, block.idx))
        if op.sub_block is not None:
            sub = program.blocks[op.sub_block]
            lines.append(f"{indent}  block {sub.idx} (parent {sub.parent_idx}) {{")
            _format_block(program, sub, indent + "    ", lines)
            lines.append(f"{indent}  }}")


def format_program(program: Program) -> str:
    """The whole Program as text; sub-blocks are printed nested under the op that owns them."""
    kind = program.metadata.get("kind", "program")
    lines = [f"program {kind}: {program.num_ops()} ops, {len(program.blocks)} block(s)"]
    feeds = ", ".join(f"{n}: {format_type(program.var(n))}" for n in program.feeds)
    lines.append(f"feeds: {feeds or '-'}")
    lines.append("fetches: " + (", ".join(f"{k}={v}" for k, v in program.fetches.items()) or "-"))
    lines.append("block 0 {")
    _format_block(program, program.global_block, "  ", lines)
    lines.append("}")
    return "\n".join(lines)


def role_counts(program: Program) -> dict[str, int]:
    """Number of ops per role label, for reports."""
    counts: dict[str, int] = {}
    for _, op in program.walk_ops():
        label = OpRole(op.role).label()
        counts[label] = counts.get(label, 0) + 1
    return counts
