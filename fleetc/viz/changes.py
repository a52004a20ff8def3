"""Which ops a pass added, removed or changed: Programs compared op by op (ops keep their names across passes)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from fleetc.ir.printer import ProgramPrinter
from fleetc.ir.program import Op, Program

SAME, ADDED, REMOVED, CHANGED = "same", "added", "removed", "changed"


@dataclass
class OpEntry:
    """One op to show, with its status against the Program before.

    `program` is the Program the op belongs to (the one before for removed ops); `index` its position
    in its block (None for removed ops); `line` the op's text; `before_line` its text before, for changed ops.
    """

    op: Op
    status: str
    program: Program
    block_idx: int
    index: int | None
    line: str
    before_line: str = ""


@dataclass
class ProgramChanges:
    """Per block of the Program after: its ops in order, removed ops placed where they used to be."""

    blocks: dict[int, list[OpEntry]]

    def count(self, status: str) -> int:
        return sum(e.status == status for entries in self.blocks.values() for e in entries)

    def summary(self) -> str:
        """`+2 added, −9 removed, ~1 changed`, or `no op changed`."""
        parts = [f"{sign}{n} {status}" for sign, status in (("+", ADDED), ("−", REMOVED), ("~", CHANGED))
                 if (n := self.count(status))]
        return ", ".join(parts) or "no op changed"


def _lines(program: Program) -> dict[str, str]:
    printer = ProgramPrinter(program)
    return {op.name: printer.op_line(op, block.idx) for block, op in program.walk_ops()}


def compare_programs(after: Program, before: Program | None) -> ProgramChanges:
    """Every op of `after` with its status; removed ops sit after the op that preceded them before.

    An op that moved to another block (e.g. into a conditional block) counts as unchanged when its
    text is the same; ops of blocks that no longer exist are listed at the end of block 0.
    """
    before_lines = _lines(before) if before is not None else {}
    after_lines = _lines(after)

    def removed(op: Op, block_idx: int) -> OpEntry:
        return OpEntry(op, REMOVED, before, block_idx, None, before_lines[op.name])
    after_names = {op.name for _, op in after.walk_ops()}
    blocks: dict[int, list[OpEntry]] = {}
    for block in after.blocks:
        old_ops = before.blocks[block.idx].ops if before is not None and block.idx < len(before.blocks) else []
        matcher = difflib.SequenceMatcher(None, [o.name for o in old_ops], [o.name for o in block.ops],
                                          autojunk=False)
        entries: list[OpEntry] = []
        for _, i1, i2, j1, j2 in matcher.get_opcodes():
            entries += [removed(op, block.idx) for op in old_ops[i1:i2] if op.name not in after_names]
            for j in range(j1, j2):
                op = block.ops[j]
                entry = OpEntry(op, SAME, after, block.idx, j, after_lines[op.name])
                if before is not None and op.name not in before_lines:
                    entry.status = ADDED
                elif before is not None and before_lines[op.name] != entry.line:
                    entry.status, entry.before_line = CHANGED, before_lines[op.name]
                entries.append(entry)
        blocks[block.idx] = entries
    if before is not None:
        for block in before.blocks[len(after.blocks):]:
            blocks[0] += [removed(op, block.idx) for op in block.ops if op.name not in after_names]
    return ProgramChanges(blocks)
