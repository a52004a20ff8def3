"""Copies of repeated blocks, verified op by op, with the names that correspond between a copy and its reference.

`find_repeated_blocks` (repeated_blocks.py) says which numbered sibling modules read alike. A pass that plans once
per distinct block and applies the plan to every copy (issue 25) needs more: for each copy, the name in the copy
of every name the reference block uses, and the certainty that the two blocks match position by position. Here
every copy whose canonical form equals its reference's is walked beside the reference: same op types, the same
argument structure and constants, outputs of the same shape, dtype, device and kind, the same fetched values, and
a one-to-one correspondence of names. A copy that fails any check is left out (its pass matches it as usual).

Reuse is on by default; `FLEETC_BLOCK_REUSE=0` turns it off, so tests can assert that a Program built with reuse
prints exactly as one built without it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from fleetc.ir.program import Op, Program, Ref
from fleetc.ir.repeated_blocks import _forms, _instance

REUSE_ENV = "FLEETC_BLOCK_REUSE"


def reuse_enabled() -> bool:
    """Whether passes may reuse one block's plan for its copies (`FLEETC_BLOCK_REUSE=0` turns it off)."""
    return os.environ.get(REUSE_ENV, "1") != "0"


@dataclass
class BlockCopies:
    """The verified copies in the global block, and how their names and op positions correspond."""

    reference: dict[str, str] = field(default_factory=dict)  # instance → its group's reference instance
    block_of: dict[str, str] = field(default_factory=dict)  # op name → instance, for every op of those instances
    slots: dict[str, list[int]] = field(default_factory=dict)  # instance → its ops' positions in the global block
    to_reference: dict[str, dict[str, str]] = field(default_factory=dict)  # instance: its name → reference's
    from_reference: dict[str, dict[str, str]] = field(default_factory=dict)  # instance: reference's name → its
    own_names: dict[str, set[str]] = field(default_factory=dict)  # names the instance's ops define or own

    def members(self, reference: str) -> list[str]:
        """The instances (reference first) sharing `reference`'s plan."""
        return [i for i, r in self.reference.items() if r == reference]

    def references(self) -> list[str]:
        return list(dict.fromkeys(self.reference.values()))


def _pair(a: Any, b: Any, names: dict[str, str]) -> bool:
    """Walk two argument values side by side: same structure and constants; Refs recorded in `names` (a → b)."""
    if isinstance(a, Ref) or isinstance(b, Ref):
        if not (isinstance(a, Ref) and isinstance(b, Ref)):
            return False
        return names.setdefault(a.name, b.name) == b.name
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_pair(x, y, names) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_pair(a[k], b[k], names) for k in a)
    return a == b


def _var_alike(program: Program, a: str, b: str, fetched: set[str]) -> bool:
    va, vb = program.find_var(a), program.find_var(b)
    if va is None or vb is None:
        return va is None and vb is None
    return ((va.shape, va.dtype, va.device, va.kind) == (vb.shape, vb.dtype, vb.device, vb.kind)
            and (a in fetched) == (b in fetched))


def correspond(program: Program, reference: list[Op], copy: list[Op]) -> dict[str, str] | None:
    """reference name → copy name when the two op lists match position by position (types, argument structure
    and constants, output types, fetched values, `forward_op` pointing at the same position), else None."""
    if len(reference) != len(copy):
        return None
    names: dict[str, str] = {}
    op_names = {a.name: b.name for a, b in zip(reference, copy)}
    fetched = set(program.fetches.values())
    for a, b in zip(reference, copy):
        if a.type != b.type or len(a.outputs) != len(b.outputs) or a.role != b.role:
            return None
        if not (_pair(a.args, b.args, names) and _pair(a.kwargs, b.kwargs, names)):
            return None
        for x, y in zip(a.outputs, b.outputs):
            if (x is None) != (y is None) or (x is not None and names.setdefault(x, y) != y):
                return None
        forward = a.attrs.get("forward_op")
        if forward is not None and op_names.get(forward, forward) != b.attrs.get("forward_op"):
            return None
    if len(set(names.values())) != len(names):
        return None  # two reference values would share one in the copy
    if not all(_var_alike(program, a, b, fetched) for a, b in names.items()):
        return None
    return names


def find_block_copies(program: Program) -> BlockCopies:
    """Group the global block's numbered sibling blocks by canonical form, and keep each copy that `correspond`s
    with its group's first member."""
    found = BlockCopies()
    blocks: dict[str, dict[str, list[tuple[int, Op]]]] = {}
    for position, op in enumerate(program.global_block.ops):
        instance = _instance(op.module_path)
        if instance is not None:
            blocks.setdefault(instance[0], {}).setdefault(instance[1], []).append((position, op))
    for instances in blocks.values():
        if len(instances) < 2:
            continue
        by_form: dict[str, list[str]] = {}
        for instance, entries in instances.items():
            forms = _forms(program, instance, [op for _, op in entries])
            by_form.setdefault(hashlib.sha256("\n".join(forms).encode()).hexdigest(), []).append(instance)
        for group in by_form.values():
            if len(group) >= 2:
                _add_group(found, program, instances, group)
    return found


def _add_group(found: BlockCopies, program: Program, instances: dict[str, list[tuple[int, Op]]],
               group: list[str]) -> None:
    reference, *copies = group
    reference_ops = [op for _, op in instances[reference]]
    verified = {reference: {n: n for op in reference_ops for n in op.inputs + op.defined}}
    for copy in copies:
        names = correspond(program, reference_ops, [op for _, op in instances[copy]])
        if names is not None:
            verified[copy] = names
    if len(verified) < 2:
        return
    for instance, names in verified.items():
        entries = instances[instance]
        found.reference[instance] = reference
        found.slots[instance] = [position for position, _ in entries]
        found.from_reference[instance] = names
        found.to_reference[instance] = {b: a for a, b in names.items()}
        own = instance + "."
        found.own_names[instance] = ({n for _, op in entries for n in op.defined}
                                     | {n for n in names.values() if own in n})
        for _, op in entries:
            found.block_of[op.name] = instance
