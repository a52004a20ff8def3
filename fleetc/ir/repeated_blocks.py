"""Repeated blocks: numbered sibling modules (`encoder.layers.0`, `.1`, …) whose ops are the same up to renaming.

A block is every op of the global block whose module path is one module instance or inside it (forward, backward
and optimizer ops alike), in Program order. Two blocks are identical when their op sequences read alike with the
instance's own name taken out: the same op types, constant arguments and attributes (module path relative to the
block, role, device, source line), the same output types, and references that point the same way: at the output
of the same earlier op of the block, at a Var named after the block (`<block>.linear1.weight` and what is named
after it), or at the n-th distinct outside value, of the same type; attributes naming an op of the block (`forward_op`) name it by
position. This is the recognition that planning once per
distinct block and applying the plan to every copy builds on (issue 25); it is one walk over the block.
"""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleetc.ir.program import Op, Program, Ref, map_refs

_NUMBERED = re.compile(r"^((?:.*?\.)?)(\d+)(?:\.|$)")  # the outermost numbered component of a module path
BLOCK = "<block>"
_UNCOMPARED = ("provenance", "fused_from")  # where an op came from, not what it does (names of removed ops)


@dataclass(frozen=True)
class RepeatedBlocks:
    """Numbered siblings under `prefix`: `members` are identical to each other (the most common form), `others`
    are the siblings that differ from them, with `differences` saying where each first differs."""

    prefix: str
    members: tuple[str, ...]
    others: tuple[str, ...]
    differences: tuple[str, ...]

    def line(self) -> str:
        """`encoder.layers: 11 of 12 blocks identical up to renaming (encoder.layers.0 differs: …)`."""
        total = len(self.members) + len(self.others)
        text = f"{self.prefix or '<model>'}: {len(self.members)} of {total} blocks identical up to renaming"
        if self.others:
            text += " (" + "; ".join(f"{o} differs: {d}" for o, d in zip(self.others, self.differences)) + ")"
        return text


def block_instance(module_path: str) -> tuple[str, str] | None:
    """(prefix, instance) of the outermost numbered component: `encoder.layers.3.fc` → (`encoder.layers`,
    `encoder.layers.3`); None outside a numbered block. How repeated blocks are grouped, here and where their
    copies are reused (block_copies.py, passes/precision/dtype_memo.py)."""
    match = _NUMBERED.match(module_path)
    if match is None:
        return None
    prefix = match.group(1).rstrip(".")
    return prefix, f"{match.group(1)}{match.group(2)}"


class _Canonical:
    """The canonical form of one block's ops: names relative to the block or by position."""

    def __init__(self, program: Program, instance: str):
        self.program, self.own = program, instance + "."
        self.local: dict[str, tuple[int, int]] = {}  # value made in the block → (op position, output position)
        self.outside: dict[str, int] = {}
        self.op_position: dict[str, int] = {}

    def _type(self, name: str, kind: bool = True) -> tuple:
        var = self.program.find_var(name)
        if var is None:
            return (None,)
        return (var.shape, var.dtype, var.device, var.kind.value if kind else None)

    def ref(self, ref: Ref) -> Any:
        name = ref.name
        if name in self.local:
            return ("local", *self.local[name])
        if self.own in name:
            return ("own", name.replace(self.own, BLOCK + ".", 1), *self._type(name))
        position = self.outside.setdefault(name, len(self.outside))
        return ("outside", position, *self._type(name, kind=False))  # a feed for the first block, a temporary after

    def _attr(self, key: str, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if key == "module_path":
            return value.replace(self.own[:-1], BLOCK, 1)
        if value in self.op_position:  # `forward_op`: an op of the block, by position
            return ("op", self.op_position[value])
        return value.replace(self.own, BLOCK + ".", 1)  # `param`: a Var named after the block

    def op(self, position: int, op: Op) -> tuple:
        attrs = {k: self._attr(k, v) for k, v in sorted(op.attrs.items()) if k not in _UNCOMPARED}
        self.op_position[op.name] = position
        form = (op.type, map_refs(op.args, self.ref), map_refs(op.kwargs, self.ref), repr(attrs),
                tuple(None if o is None else self._type(o) for o in op.outputs))
        for i, name in enumerate(op.outputs):
            if name is not None:
                self.local[name] = (position, i)
        return form


def _forms(program: Program, instance: str, ops: list[Op]) -> list[str]:
    canonical = _Canonical(program, instance)
    return [repr(canonical.op(i, op)) for i, op in enumerate(ops)]


def _first_difference(forms: list[str], reference: list[str], ops: list[Op]) -> str:
    for i, (form, expected) in enumerate(zip(forms, reference)):
        if form != expected:
            return f"op {i} ({ops[i].name}, {ops[i].type})"
    return f"{len(forms)} ops where the others have {len(reference)}"


def find_repeated_blocks(program: Program) -> list[RepeatedBlocks]:
    """Every run of two or more numbered sibling modules in the global block, grouped by identical form."""
    blocks: dict[str, dict[str, list[Op]]] = {}
    for op in program.global_block.ops:
        found = block_instance(op.module_path)
        if found is not None:
            blocks.setdefault(found[0], {}).setdefault(found[1], []).append(op)
    result = []
    for prefix, instances in blocks.items():
        if len(instances) < 2:
            continue
        forms = {instance: _forms(program, instance, ops) for instance, ops in instances.items()}
        digests = {instance: hashlib.sha256("\n".join(f).encode()).hexdigest() for instance, f in forms.items()}
        common, _ = Counter(digests.values()).most_common(1)[0]
        members = tuple(i for i in instances if digests[i] == common)
        others = tuple(i for i in instances if digests[i] != common)
        reference = forms[members[0]]
        differences = tuple(_first_difference(forms[o], reference, instances[o]) for o in others)
        result.append(RepeatedBlocks(prefix, members, others, differences))
    return result
