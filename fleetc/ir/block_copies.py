"""Copies of repeated blocks, verified op by op, with the names that correspond between a copy and its reference.

`find_repeated_blocks` (repeated_blocks.py) says which numbered sibling modules read alike. A pass that plans once
per distinct block and applies the plan to every copy (issue 25) needs more: for each copy, the name in the copy
of every name the reference block uses, and the certainty that the two blocks match position by position. Here
each block is walked beside a reference block (`correspond`): same op types, roles and attributes, the same
argument structure and constants, Vars of the same shape, dtype, device and kind, the same fetched values, and a
one-to-one correspondence of names. A block that matches no earlier block is a reference of its own; one with no
copy is left out (its pass matches it as usual). The walk is done by each pass that reuses plans, on the Program
it is given: earlier passes may have changed any block.

`FLEETC_BLOCK_REUSE` chooses who reuses (`reuse_enabled`): `1` all, `0` none, or a list (`fusion,amp,recompute`); by
default only AMP. Tests assert that a Program built with reuse prints exactly as one built without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from fleetc.ir.program import Op, Program, Ref
from fleetc.ir.repeated_blocks import block_instance

REUSE_ENV = "FLEETC_BLOCK_REUSE"
REUSERS = ("amp", "fusion", "recompute")
# AMP's memo saves most of its pass's time; replaying fusion answers costs more than the matchers it skips (the
# copies are verified in each pass, and one such walk costs more than all the matchers' work: bench/README.md), so
# it is opt-in.
DEFAULT_REUSERS = ("amp",)


def reuse_enabled(reuser: str) -> bool:
    """Whether `reuser` (one of `REUSERS`) reuses plans across identical blocks: `FLEETC_BLOCK_REUSE` is `0` (none),
    `1` (all) or a comma-separated list of reusers; unset, only AMP does."""
    value = os.environ.get(REUSE_ENV)
    if value is None:
        return reuser in DEFAULT_REUSERS
    return value == "1" or reuser in value.split(",")


@dataclass
class BlockCopies:
    """The verified copies in the global block, and how their names and op positions correspond."""

    reference: dict[str, str] = field(default_factory=dict)  # instance → its group's reference instance
    block_of: dict[str, str] = field(default_factory=dict)  # op name → instance, for every op of those instances
    slots: dict[str, list[int]] = field(default_factory=dict)  # instance → its ops' positions in the global block
    to_reference: dict[str, dict[str, str]] = field(default_factory=dict)  # instance: its name → reference's
    from_reference: dict[str, dict[str, str]] = field(default_factory=dict)  # instance: reference's name → its
    own_names: dict[str, set[str]] = field(default_factory=dict)  # names the instance's ops define or own
    ops: dict[str, list[Op]] = field(default_factory=dict)  # instance → its ops when the copies were found

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


def _attrs_alike(a: Op, b: Op, own: tuple[str, str], op_names: dict[str, str]) -> bool:
    """The same attributes, strings read relative to the block (module paths, Vars named after it, ops of it by
    their position); `fused_from` (names of ops a fusion removed) says where an op came from, not what it does."""
    if a.attrs.keys() != b.attrs.keys():
        return False
    for key, x in a.attrs.items():
        y = b.attrs[key]
        if key == "fused_from" or x == y:
            continue
        if not (isinstance(x, str) and isinstance(y, str)):
            return False
        if op_names.get(x, x.replace(own[0], own[1], 1)) != y:
            return False
    return True


def correspond(program: Program, reference: tuple[str, list[Op]], copy: tuple[str, list[Op]]) -> dict[str, str] | None:
    """reference name → copy name when the two blocks' ops (instance, ops) match position by position: op types,
    roles and attributes, argument structure and constants, a one-to-one pairing of the Vars they name, of the
    same shape, dtype, device and kind, fetched alike; else None."""
    (ref_instance, ref_ops), (instance, ops) = reference, copy
    if len(ref_ops) != len(ops):
        return None
    names: dict[str, str] = {}
    op_names = {a.name: b.name for a, b in zip(ref_ops, ops)}
    own = (ref_instance, instance)
    fetched = set(program.fetches.values())
    for a, b in zip(ref_ops, ops):
        if a.type != b.type or len(a.outputs) != len(b.outputs) or not _attrs_alike(a, b, own, op_names):
            return None
        if not (_pair(a.args, b.args, names) and _pair(a.kwargs, b.kwargs, names)):
            return None
        for x, y in zip(a.outputs, b.outputs):
            if (x is None) != (y is None) or (x is not None and names.setdefault(x, y) != y):
                return None
    if len(set(names.values())) != len(names):
        return None  # two reference values would share one in the copy
    if not all(_var_alike(program, a, b, fetched) for a, b in names.items()):
        return None
    return names


def find_block_copies(program: Program) -> BlockCopies:
    """Group the global block's numbered sibling blocks: each block is a copy of the first earlier block it
    `correspond`s with (the last one matched is tried first), or a reference of its own."""
    found = BlockCopies()
    blocks: dict[str, dict[str, list[tuple[int, Op]]]] = {}
    for position, op in enumerate(program.global_block.ops):
        instance = block_instance(op.module_path)
        if instance is not None:
            blocks.setdefault(instance[0], {}).setdefault(instance[1], []).append((position, op))
    for instances in blocks.values():
        if len(instances) < 2:
            continue
        groups: dict[str, dict[str, dict[str, str]]] = {}  # reference → {member: reference name → its name}
        for instance, entries in instances.items():
            ops = [op for _, op in entries]
            for reference in sorted(groups, key=lambda r: -len(groups[r])):
                names = correspond(program, (reference, [op for _, op in instances[reference]]), (instance, ops))
                if names is not None:
                    groups[reference][instance] = names
                    break
            else:
                groups[instance] = {instance: {n: n for op in ops for n in op.inputs + op.defined}}
        for reference, members in groups.items():
            if len(members) >= 2:
                _add_group(found, instances, reference, members)
    return found


def _add_group(found: BlockCopies, instances: dict[str, list[tuple[int, Op]]], reference: str,
               members: dict[str, dict[str, str]]) -> None:
    for instance, names in members.items():
        entries = instances[instance]
        found.reference[instance] = reference
        found.slots[instance] = [position for position, _ in entries]
        found.ops[instance] = [op for _, op in entries]
        found.from_reference[instance] = names
        found.to_reference[instance] = {b: a for a, b in names.items()}
        own = instance + "."
        found.own_names[instance] = ({n for _, op in entries for n in op.defined}
                                     | {n for n in names.values() if own in n})
        for _, op in entries:
            found.block_of[op.name] = instance
