"""Points an eval Program at the named targets and drops, by dead-code elimination, every op they do not need.

Paddle's `save_inference_model` prunes its program to the fetch targets; here a target is
- `output`: the model's whole output, or `output.<i>`: one leaf of it (the eval Program's fetch keys);
- a module path (`layers.0.mlp`): that module's output, as recompute checkpoints name it;
- the name of a value in the eval Program (`relu_1`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetc.errors import ExportError
from fleetc.ir.program import Program
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import drop_unused_temporaries, eliminate_dead_ops
from fleetc.passes.recompute import RecomputePolicy
from fleetc.passes.recompute.checkpoints import module_outputs
from fleetc.passes.recompute.plan import forward_region
from fleetc.strategy.names import closest

WHOLE_OUTPUT = "output"


def _outputs(program: Program) -> dict[str, str]:
    return {key: var for key, var in program.fetches.items() if key.startswith(WHOLE_OUTPUT + ".")}


def resolve_targets(program: Program, targets: Sequence[str]) -> dict[str, str]:
    """Fetch key → Var name for each target, in order; an unknown name raises ExportError with the closest ones."""
    outputs = _outputs(program)
    modules = module_outputs(forward_region(program, RecomputePolicy()))
    values = {n for _, op in program.walk_ops() for n in op.defined} | set(program.feeds)
    fetches: dict[str, str] = {}
    for target in targets:
        if target == WHOLE_OUTPUT:
            fetches.update(outputs)
        elif target in outputs:
            fetches[target] = outputs[target]
        elif target in modules:
            fetches[target] = modules[target]
        elif target in values:
            fetches[target] = target
        else:
            candidates = [WHOLE_OUTPUT, *outputs, *modules, *values]
            hint = closest(target, candidates)
            raise ExportError(f"target_vars: {target!r} names no output, module or value of the eval Program"
                              + (f"; did you mean {hint!r}?" if hint else "")
                              + f" (outputs: {', '.join([WHOLE_OUTPUT, *outputs])}; "
                              f"module paths: {', '.join(sorted(modules)[:20]) or 'none'})")
    return fetches


class PruneToTargets:
    """The Program fetches `fetches` (key → Var, from `resolve_targets`) and is fed `feeds` first, in that order.

    With `prune` (Paddle's `export_for_deployment`), ops the fetches do not need are removed, then the state and
    inputs nothing reads; without it every op stays and only the fetches change. An input the fetches read but
    `feeds` leaves out stays fed (after `feeds`), so the Program stays valid: the caller decides if that is an error.
    """

    name = "prune_to_targets"
    summary = "fetch the export targets and drop the ops they do not need"
    reads: tuple[str, ...] = ()

    def __init__(self, fetches: dict[str, str], feeds: Sequence[str], prune: bool = True):
        self.fetches = dict(fetches)
        self.feeds = list(feeds)
        self.prune = prune

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name, changed=True)
        program.fetches = dict(self.fetches)
        block = program.global_block
        if self.prune:
            report.count("ops_removed", eliminate_dead_ops(program, block, set(program.fetches.values())))
            report.count("vars_removed", drop_unused_temporaries(program))
        read = {n for op in block.ops for n in op.inputs} | set(program.fetches.values())
        if self.prune:
            for var in [v for v in program.persistables() if v.name not in read]:
                del block.vars[var.name]
                report.count("state_removed")
        needed_extra = [n for n in program.feeds if n in read and n not in self.feeds]
        for name in [n for n in program.feeds if n not in self.feeds and n not in needed_extra]:
            del block.vars[name]
        program.feeds = self.feeds + needed_extra
        unused = [name for name in self.feeds if name not in read]
        if unused:
            report.notes.append(f"inputs the targets do not read (the exported module takes and ignores them): "
                                f"{unused}")
        report.count("targets", len(program.fetches))
        return program, report
