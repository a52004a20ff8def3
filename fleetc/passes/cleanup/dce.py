"""Dead-code elimination: drops ops whose results nobody reads and that have no side effect."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.constants import drop_unused_constants
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Block, Op, Program, VarKind
from fleetc.ir.registry import resolve_callable
from fleetc.passes.base import PassReport


def has_side_effect(program: Program, block: Block, op: Op) -> bool:
    """Writes persistable state, owns a sub-block, or draws random numbers (dropping it would shift the RNG stream)."""
    if op.sub_block is not None or not op.type.startswith("aten."):
        return True
    if any(program.var(n, block.idx).kind is not VarKind.TEMP for n in op.defined):
        return True
    overload = resolve_callable(op.type)
    return torch.Tag.nondeterministic_seeded in overload.tags


def dead_op_names(program: Program, block: Block, keep: set[str]) -> set[str]:
    """The ops of one block whose results nothing live reads and that have no side effect (one backward sweep)."""
    needed = set(keep)
    dead: set[str] = set()
    for op in reversed(block.ops):
        if has_side_effect(program, block, op) or any(n in needed for n in op.defined):
            needed.update(block_reads(program, op))
        else:
            dead.add(op.name)
    return dead


def eliminate_dead_ops(program: Program, block: Block, keep: set[str]) -> int:
    """Remove dead ops from one block; returns how many were removed."""
    dead = dead_op_names(program, block, keep)
    removed = [op.name for op in block.ops if op.name in dead]
    block.ops = [op for op in block.ops if op.name not in dead]
    program.repoint_forward_ops(dict.fromkeys(removed))
    return len(removed)


def drop_unused_temporaries(program: Program) -> int:
    """Forget temporaries and lifted constants that no op defines or reads any more."""
    used = {n for _, op in program.walk_ops() for n in (*op.inputs, *op.defined)} | set(program.fetches.values())
    dropped = drop_unused_constants(program, used)
    for block in program.blocks:
        for name in [n for n, v in block.vars.items() if v.kind is VarKind.TEMP and n not in used]:
            del block.vars[name]
            dropped += 1
    return dropped


class DeadCodeElimination:
    name = "dead_code_elimination"
    enabled_by = None  # always in the order: it decides for itself whether there is work
    summary = "drop ops whose results are never read and that have no side effect"
    reads: tuple[str, ...] = ()

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        for block in reversed(program.blocks):
            report.count("ops_removed", eliminate_dead_ops(program, block, set(program.fetches.values())))
        report.count("vars_removed", drop_unused_temporaries(program))
        report.changed = report.stats["ops_removed"] > 0 or report.stats["vars_removed"] > 0
        return program, report
