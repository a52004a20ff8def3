"""Deterministic text form of a Program: one op per line, `outputs = type(inputs) {attrs}  # role module source`.

The form is complete: `fleetc.ir.parser` reads it back into an equal Program (docs/ir.md describes it).
"""
from __future__ import annotations

import collections
import os
from typing import Any, Iterator

import sympy
import torch

from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.text_syntax import (
    ABSENT,
    BARE_NOTE,
    DTYPE_SHORT,
    KEY,
    NOTE_KEYS,
    SOURCE_NOTE,
    TORCH_CONSTANTS,
    is_bare_module_path,
    is_bare_name,
)

# Attributes the notes and the nesting show; the rest are printed inside braces.
STANDARD_ATTRS = ("op_role", "module_path", "source", *NOTE_KEYS, "sub_block")
INDENT = "  "


def format_name(name: str) -> str:
    """A Var name as written in op lines: bare, or `%'…'` when it could be read as something else."""
    return name if is_bare_name(name) else "%" + repr(name)


def _format_key(key: Any) -> str:
    return key if isinstance(key, str) and KEY.fullmatch(key) else repr(key)


def format_value(value: Any) -> str:
    """An argument, attribute or metadata value in the text form's value syntax (Python-like, Vars bare)."""
    if isinstance(value, Ref):  # a Ref without a name is broken IR: shown readably for the verifier's message
        return format_name(value.name) if value.name is not None else "%<no name>"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(format_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, TORCH_CONSTANTS):
        return str(value)
    if isinstance(value, torch.device):
        return f"device({str(value)!r})"
    if isinstance(value, sympy.Basic):
        return f"sym({str(value)!r})"
    return f"<{type(value).__qualname__} {value!r}>"  # no text form: the parser refuses it by name


def format_type(var: Var, default_device: str | None = None) -> str:
    """`f32[8,16]` for tensors, `f64` for host scalars; `@device` when it is not `default_device`."""
    dtype = DTYPE_SHORT.get(var.dtype, var.dtype)
    text = dtype if var.shape is None else f"{dtype}[{','.join(str(d) for d in var.shape)}]"
    if default_device is not None and var.device != default_device:
        text += f"@{var.device}"
    return text


class ProgramPrinter:
    """Prints one Program; what depends on the whole Program (default device, source files) is decided once."""

    def __init__(self, program: Program):
        self.program = program
        devices = collections.Counter(v.device for v in program.all_vars())
        self.default_device = min(devices, key=lambda d: (-devices[d], d)) if devices else "cpu"
        paths = {op.attrs["source"].rpartition(":")[0] for _, op in program.walk_ops()
                 if isinstance(op.attrs.get("source"), str)}
        names = collections.Counter(os.path.basename(p) for p in paths)
        # Source files written by file name in op lines; the `sources:` header line gives their full paths.
        self.short_sources = sorted(p for p in paths if os.path.basename(p) != p and names[os.path.basename(p)] == 1)
        # The op each sub-block is printed under: the first op naming it (the verifier allows only one).
        self.owners: dict[int, Op] = {}
        for _, op in program.walk_ops():
            if isinstance(op.sub_block, int) and 0 < op.sub_block < len(program.blocks):
                self.owners.setdefault(op.sub_block, op)

    # ----- op lines

    def op_line(self, op: Op, block_idx: int = 0) -> str:
        """One line: outputs with types, the call, attrs the notes do not show, then role · module · source."""
        outs = []
        for name in op.outputs:
            if name is None:
                outs.append("_")
                continue
            var = self.program.find_var(name, block_idx)
            shown = format_name(name)
            outs.append(f"{shown}: {format_type(var, self.default_device)}" if var is not None else shown)
        call_args = [format_value(a) for a in op.args] + [f"{_format_key(k)}={format_value(v)}"
                                                          for k, v in op.kwargs.items()]
        line = f"{', '.join(outs) or '()'} = {op.type}({', '.join(call_args)})"
        notes, braced = self._notes(op)
        if braced:
            line += " {" + ", ".join(f"{_format_key(k)}={format_value(v)}" for k, v in sorted(braced.items())) + "}"
        return f"{line}  # {'  '.join(notes)}"

    def _notes(self, op: Op) -> tuple[list[str], dict]:
        """The trailing notes, and the attrs they cannot show (printed in braces instead)."""
        attrs = dict(op.attrs)
        role = attrs.get("op_role")
        if isinstance(role, int) and not isinstance(role, bool) and OpRole.parse(OpRole(role).label()) == role:
            notes = [OpRole(role).label()]
            del attrs["op_role"]
        else:
            notes = [ABSENT]
        module = attrs.get("module_path")
        if module == "":
            del attrs["module_path"]
        elif isinstance(module, str) and is_bare_module_path(module):
            notes.append(module)
            del attrs["module_path"]
        elif isinstance(module, str):
            notes.append(f"module_path={module!r}")
            del attrs["module_path"]
        else:
            notes.append(ABSENT)
        for key in NOTE_KEYS:
            if isinstance(attrs.get(key), str):
                notes.append(_note(key, attrs.pop(key)))
        source = attrs.get("source")
        if isinstance(source, str):
            notes.append(self._source_note(attrs.pop("source")))
        if op.name != (op.outputs[0] if op.outputs else None):
            notes.append(_note("name", op.name))
        if self.nested_block(op) is not None:
            del attrs["sub_block"]
        return notes, attrs

    def _source_note(self, source: str) -> str:
        path, _, line = source.rpartition(":")
        shown = f"{os.path.basename(path)}:{line}" if path in self.short_sources else source
        return shown if SOURCE_NOTE.fullmatch(shown) else f"source={source!r}"

    # ----- the whole Program

    def text(self) -> str:
        """The whole Program; sub-blocks are printed nested under the op that owns them."""
        program = self.program
        kind = program.metadata.get("kind")
        kind_shown = isinstance(kind, str) and is_bare_name(kind)
        lines = [f"program{' ' + kind if kind_shown else ''}: {program.num_ops()} ops, {len(program.blocks)} block(s)"]
        if self.default_device != "cpu":
            lines.append(f"device: {self.default_device}")
        if self.short_sources:
            lines.append("sources: " + ", ".join(p if BARE_NOTE.fullmatch(p) and "," not in p else repr(p)
                                                 for p in self.short_sources))
        feeds = ", ".join(f"{format_name(n)}: {format_type(v)}" if (v := program.find_var(n)) else format_name(n)
                          for n in program.feeds)
        lines.append(f"feeds: {feeds or '-'}")
        lines.append("fetches: " + (", ".join(f"{_format_key(k)}={format_name(v)}"
                                               for k, v in program.fetches.items()) or "-"))
        for key, value in program.metadata.items():
            if not (key == "kind" and kind_shown):
                lines.append(f"meta {_format_key(key)} = {format_value(value)}")
        self._declared = _declarations(program, list(self._events()))
        for block_idx in self._top_level_blocks():
            self._block_lines(program.blocks[block_idx], "", lines)
        return "\n".join(lines)

    def _block_lines(self, block: Block, indent: str, lines: list[str]) -> None:
        parent = f" (parent {block.parent_idx})" if block.idx or block.parent_idx != -1 else ""
        lines.append(f"{indent}block {block.idx}{parent} {{")
        inner = indent + INDENT
        for var in sorted(self._declared[block.idx], key=lambda v: v.name):
            lines.append(f"{inner}{var.kind.value} {format_name(var.name)}: {format_type(var)} {var.device}")
        for op in block.ops:
            sub = self.nested_block(op)
            lines.append(inner + self.op_line(op, block.idx))
            if sub is not None:
                self._block_lines(self.program.blocks[sub], inner + INDENT, lines)
        lines.append(f"{indent}}}")

    def nested_block(self, op: Op) -> int | None:
        """The sub-block printed under `op`, if `op` is the one it is printed under."""
        return op.sub_block if self.owners.get(op.sub_block) is op else None

    def _top_level_blocks(self) -> list[int]:
        """Block 0, then blocks no op owns (printed so that nothing is lost; the verifier rejects them)."""
        return [0, *(i for i in range(1, len(self.program.blocks)) if i not in self.owners)]

    def _events(self) -> Iterator[tuple[int, Op | None]]:
        """(block, op) in printed order; (block, None) where a block's lines begin."""

        def visit(idx: int) -> Iterator[tuple[int, Op | None]]:
            yield idx, None
            for op in self.program.blocks[idx].ops:
                yield idx, op
                sub = self.nested_block(op)
                if sub is not None:
                    yield from visit(sub)

        for idx in self._top_level_blocks():
            yield from visit(idx)


def _note(key: str, value: str) -> str:
    return f"{key}={value if BARE_NOTE.fullmatch(value) else repr(value)}"


def _declarations(program: Program, events: list[tuple[int, Op | None]]) -> dict[int, list[Var]]:
    """The Vars each block must declare at its top: everything but temporaries the parser recreates.

    The parser creates a temporary where an op line first writes a name it cannot resolve, in that op's block.
    Replaying the printed order finds the temporaries for which that lands on the right Var; the others (read
    before written, written from another block, shadowing a parent's Var) are declared. Declaring one can change
    how later names resolve, so the replay repeats until nothing new needs declaring.
    """
    declared = {(b.idx, n) for b in program.blocks for n, v in b.vars.items() if v.kind is not VarKind.TEMP}
    while True:
        before = len(declared)
        known: dict[int, set[str]] = {}
        for block_idx, op in events:
            if op is None:
                known[block_idx] = {n for b, n in declared if b == block_idx}
                continue
            for name in op.defined:
                owner = _owner_block(program, name, block_idx)
                resolved = _owner_block(program, name, block_idx, known)
                if resolved is None and owner == block_idx:
                    known[block_idx].add(name)
                elif owner is not None and resolved != owner:
                    declared.add((owner, name))
        declared |= {(b.idx, n) for b in program.blocks for n in b.vars if n not in known.get(b.idx, ())}
        if len(declared) == before:
            return {b.idx: [v for n, v in b.vars.items() if (b.idx, n) in declared] for b in program.blocks}


def _owner_block(program: Program, name: str, block_idx: int, known: dict[int, set[str]] | None = None) -> int | None:
    """The block whose Var `name` resolves to from `block_idx` (among `known` names when given)."""
    seen = set()
    while 0 <= block_idx < len(program.blocks) and block_idx not in seen:
        seen.add(block_idx)
        names = program.blocks[block_idx].vars if known is None else known.get(block_idx, ())
        if name in names:
            return block_idx
        block_idx = program.blocks[block_idx].parent_idx
    return None


def format_op(op: Op, program: Program, block_idx: int = 0) -> str:
    """One op's line as the Program's text shows it (build one `ProgramPrinter` to print many)."""
    return ProgramPrinter(program).op_line(op, block_idx)


def format_program(program: Program) -> str:
    """The whole Program as text; `fleetc.ir.parser.parse_program` reads it back."""
    return ProgramPrinter(program).text()


def role_counts(program: Program) -> dict[str, int]:
    """Number of ops per role label, for reports."""
    counts: dict[str, int] = {}
    for _, op in program.walk_ops():
        label = OpRole(op.role).label()
        counts[label] = counts.get(label, 0) + 1
    return counts
