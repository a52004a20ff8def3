"""Shared machinery of the named fusion passes: who reads what, and swapping a matched group for one fused op.

Every block is fused on its own, block by block in program order: a group never spans a block boundary,
and an op owning a sub-block reads (for the analysis here) everything its sub-block reads.
Within a block, a fusion pass finds forward groups in program order (the earliest op claims it, so overlapping
matches resolve the same way every time), replaces each by one fused op, then derives the backward
group from the forward one — the backward ops whose `forward_op` is a member — so forward and
backward always fuse the same branch. A forward group whose backward cannot be fused is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from fleetc.ir.block_copies import find_block_copies, reuse_enabled
from fleetc.ir.program import Block, Op, OpRole, Program, Var, VarKind
from fleetc.ir.usedef import Names, UseDef, hand_on, handed_on
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import drop_unused_temporaries
from fleetc.passes.fusion.reuse import FusionPlans, Watch


class BlockIndex(UseDef):
    """The block's use-def information (fleetc.ir.usedef) plus what fusion matching asks of it.

    Built once per block, or taken from the previous fusion pass (`fleetc.ir.usedef.handed_on`): a fusion removes its
    members from the index and adds the fused op in place (`apply_fusion`), so matching the whole block costs time
    linear in its size.
    """

    def __init__(self, program: Program, block: Block, by_forward: dict[str, list[Op]], names: Names):
        previous = handed_on(program, block)
        if previous is None:
            super().__init__(program, block)
        else:
            self.share(previous)
        self.fetched = set(program.fetches.values())
        self.by_forward = by_forward  # program-wide: forward op name → the backward ops naming it
        self.names = names  # fused ops get fresh names
        self.watch: Watch | None = None  # while a matcher runs on a repeated block's op (fusion/reuse.py)

    def var(self, name: str) -> Var:
        """The Var `name` as this block sees it (its own, or an ancestor block's)."""
        if self.watch:
            self.watch.name(self, name)
        return self.program.var(name, self.block.idx)

    def readers_of(self, name: str) -> list[Op]:
        """The ops reading `name`."""
        readers = self.readers.get(name, [])
        if self.watch:
            self.watch.name(self, name)
            self.watch.ops(readers)
        return readers

    def definer(self, name: str) -> Op | None:
        op = super().definer(name)
        if self.watch:
            self.watch.name(self, name)
            self.watch.ops([op])
        return op

    def next_in_chain(self, name: str) -> Op | None:
        """The one non-backward op reading a temporary, when every other reader is a backward op (which then
        reads the value from the fused op's extra output) and no fetch needs it; else None."""
        if name in self.fetched or self.var(name).kind is not VarKind.TEMP:
            return None
        forward = [op for op in self.readers_of(name) if OpRole.BACKWARD not in op.role]
        return forward[0] if len(forward) == 1 else None

    def read_outside(self, name: str, group: list[Op]) -> bool:
        if self.watch:
            self.watch.name(self, name)
            self.watch.ops(group)
        members = {op.name for op in group}
        return name in self.fetched or any(r.name not in members for r in self.readers.get(name, []))

    def backward_of(self, forward_name: str) -> list[Op]:
        """The live ops differentiating `forward_name` (dead ones, e.g. an unused input grad, are DCE's job)."""
        ops = [op for op in self.by_forward.get(forward_name, []) if self.live(op)]
        if self.watch:
            self.watch.ops(ops)
        return sorted((op for op in ops if any(self._needed_fact(n) for n in op.defined)),
                      key=lambda op: self.position[op.name])

    def needed(self, name: str) -> bool:
        """Whether anything still needs the value `name`: a fetch, a reader, or the state it is part of."""
        return name in self.fetched or bool(self.readers.get(name)) or self.program.var(name, self.block.idx).persistable

    def _needed_fact(self, name: str) -> bool:
        needed = self.needed(name)
        if self.watch:
            self.watch.fact(name, needed)
        return needed

    def fuse(self, group: list[Op], fused: Op, at: int, rename: dict[str, str]) -> None:
        """Put `fused` in slot `at`, empty the members' slots, and point readers of renamed values at the new ones."""
        self.replace(group, fused, at)
        for old, new in rename.items():
            self.rename(old, new)
        for member in group:  # backward ops that named a member now name the fused op
            for backward in self.by_forward.pop(member.name, []):
                backward.attrs["forward_op"] = fused.name
                self.by_forward.setdefault(fused.name, []).append(backward)


@dataclass
class Fusion:
    """A matched group and the op replacing it; `rename` maps removed values onto equal surviving ones."""

    group: list[Op]
    fused: Op
    rename: dict[str, str] = field(default_factory=dict)


def kept(index: BlockIndex, group: list[Op], name: str | None) -> str | None:
    """`name` when a value computed inside the group is read after it, else None (the fused op drops it)."""
    return name if name is not None and index.read_outside(name, group) else None


def _anchor(index: BlockIndex, fusion: Fusion) -> int | None:
    """Where the fused op can stand: at the group's first op if its inputs exist by then, else at its last."""
    positions = sorted(index.position[op.name] for op in fusion.group)
    members = {op.name for op in fusion.group}
    # persistables and feeds hold a value all step long; only temporaries have a position to respect
    inputs = [n for n in fusion.fused.inputs if index.var(n).kind is VarKind.TEMP
              and index.definer(n) is not None and index.definer(n).name not in members]
    if all(index.position[index.definer(n).name] < positions[0] for n in inputs):
        return positions[0]
    outputs = [n for n in fusion.fused.defined]
    if all(index.position[r.name] > positions[-1] for n in outputs for r in index.readers.get(n, [])
           if r.name not in members):
        return positions[-1]
    return None


def leaked_values(index: BlockIndex, fusion: Fusion) -> list[str]:
    """Values the group computes that are read after it but that the fused op neither returns nor renames."""
    provided = set(fusion.fused.defined) | set(fusion.rename)
    return [n for op in fusion.group for n in op.defined if n not in provided and index.read_outside(n, fusion.group)]


def apply_fusion(index: BlockIndex, fusion: Fusion, pass_name: str) -> str | None:
    """Swap the group for the fused op; or say why not (Program untouched)."""
    leaked = leaked_values(index, fusion)
    if leaked:
        return f"values {leaked} computed inside the group are read outside it"
    at = _anchor(index, fusion)
    if at is None:
        return "no position keeps every input defined before use"
    first = fusion.group[0]
    fused = fusion.fused
    fused.name = index.names.fresh(fused.name)
    role = OpRole(0)
    for op in fusion.group:
        role |= op.role
    fused.attrs = {"op_role": int(role), "module_path": first.module_path, "provenance": pass_name,
                   "fused_from": [op.name for op in fusion.group],
                   **{k: first.attrs[k] for k in ("forward_op", "op_device", "source") if k in first.attrs}}
    index.fuse(fusion.group, fused, at, fusion.rename)
    return None


Matcher = Callable[[BlockIndex, Op], "Fusion | None"]
BackwardMatcher = Callable[[BlockIndex, Op, list], "Fusion | str"]


def fuse_forward_and_backward(program: Program, report: PassReport, pass_name: str, match_forward: Matcher,
                              match_backward: BackwardMatcher | None) -> None:
    """Fuse every forward group `match_forward` finds, then each one's backward group, one block at a time.

    `match_backward(index, fused_forward_op, backward_ops)` returns the backward Fusion, or a reason
    (str) why this group's backward cannot be fused; it is only called when backward ops exist.
    """
    by_forward: dict[str, list[Op]] = {}
    block_of: dict[str, int] = {}
    names = Names(program)
    for block, op in program.walk_ops():
        block_of[op.name] = block.idx
        if "forward_op" in op.attrs:
            by_forward.setdefault(op.attrs["forward_op"], []).append(op)
    for block in program.blocks:
        copies = find_block_copies(program) if block.idx == 0 and reuse_enabled("fusion") else None
        plans = FusionPlans(copies) if copies and copies.reference else None
        groups = _fuse_block(BlockIndex(program, block, by_forward, names), report, pass_name, match_forward,
                             match_backward, block_of, plans)
        if plans is not None:
            report.reused_blocks += plans.lines()
        if groups and block.idx != 0:
            report.notes.append(f"block {block.idx}: {groups} forward group(s) fused inside the sub-block")
        report.changed |= groups > 0
    if report.changed:
        drop_unused_temporaries(program)


def _apply(index: BlockIndex, fusion: Fusion, pass_name: str, plans: FusionPlans | None) -> str | None:
    """apply_fusion, with the repeated-block plans told what it touched and whether it succeeded."""
    if plans is None:
        return apply_fusion(index, fusion, pass_name)
    plans.before_apply(index, fusion)
    why = apply_fusion(index, fusion, pass_name)
    plans.after_apply(fusion, why is None)
    return why


def _fuse_block(index: BlockIndex, report: PassReport, pass_name: str, match_forward: Matcher,
                match_backward: BackwardMatcher | None, block_of: dict[str, int],
                plans: FusionPlans | None = None) -> int:
    """Fuse one block's forward groups and their backward groups in that block; returns the forward groups fused.
    With `plans`, the matchers' answers for copies of a repeated block are reused (fusion/reuse.py)."""
    block = index.block
    fused_forward: list[Op] = []
    i = 0
    while i < len(index.slots):
        op = index.slots[i]
        if op is None:
            fusion = None
        elif plans is None:
            fusion = match_forward(index, op)
        else:
            fusion = plans.ask(index, i, op, "forward", lambda op=op: match_forward(index, op))
        if fusion is not None and _apply(index, fusion, pass_name, plans) is None:
            fused_forward.append(fusion.fused)
            block_of[fusion.fused.name] = block.idx
            report.count("forward_groups")
            report.count("ops_removed", len(fusion.group) - 1)
            continue  # slot i now holds the fused op, or is empty when the fused op stands at the group's end
        i += 1
    for fwd in fused_forward:
        elsewhere = sorted({block_of[op.name] for op in index.by_forward.get(fwd.name, [])} - {block.idx})
        if match_backward is None:
            continue
        if elsewhere:  # a group never spans blocks
            why = f"backward ops in block(s) {elsewhere}, forward in block {block.idx}"
        else:
            def ask(fwd: Op = fwd) -> Fusion | str | None:
                backward = index.backward_of(fwd.name)
                return match_backward(index, fwd, backward) if backward else None

            result = ask() if plans is None else plans.ask(index, index.position[fwd.name], fwd, "backward", ask)
            if result is None:
                continue
            why = result if isinstance(result, str) else _apply(index, result, pass_name, plans)
            if why is None:
                block_of[result.fused.name] = block.idx
        if why is not None:
            report.count("backward_not_fused")
            report.notes.append(f"{fwd.name} ({fwd.module_path or 'top level'}): forward fused, backward not: {why}")
            continue
        report.count("backward_groups")
        report.count("ops_removed", len(result.group) - 1)
    index.compact()
    hand_on(index)
    return len(fused_forward)


def no_match_reason(report: PassReport, pattern: str) -> None:
    """Fill the report's skipped_reason when the pass's flag was on but nothing was fused."""
    if not report.changed:
        report.skipped_reason = f"flag on, but the Program has no {pattern} left to fuse"
