"""Gradient merge: sum gradients every step, run the optimizer update once every k steps in a conditional block.

Paddle's GradientMergeOptimizer, on the Program IR. Every step adds each gradient into a persistable
accumulator `<grad>@MERGE` (`w@GRAD@MERGE`) and advances the persistable counter `gradient_merge@step`
(cycling 0..k-1). A `fleetc.conditional_block` whose sub-block runs when the counter is back at 0
divides the accumulators by k (avg), runs the update ops on them and zeroes them.

The update is every op with the optimize or lr_sched role, plus every collective whose results only
the update reads (a gradient allreduce; a sync-BN allreduce feeds the forward and stays), so
collectives added before this pass run once per k steps (data-parallel gradient allreduces come
later: insert_allreduce puts them into the update block, see allreduce_merged.py). Any temporary
flowing from the per-step ops into the update is what gets accumulated, whatever op types produce
or read it.
`program.metadata["gradient_merge"]` names the update block and the accumulators for later passes.
"""
from __future__ import annotations

from typing import Any

from fleetc.errors import PassError
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.parameter_server import ps_metadata
from fleetc.passes.pipeline_parallel.stages import pipelined

PROVENANCE = "gradient_merge"
_UPDATE_ROLES = OpRole.OPTIMIZE | OpRole.LR_SCHED


def update_op_indices(program: Program, block: Block) -> set[int]:
    """Indices of the ops that form the optimizer update (see the module docstring)."""
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(block.ops):
        for name in block_reads(program, op):
            readers.setdefault(name, []).append(i)
    update: set[int] = set()
    for i in reversed(range(len(block.ops))):
        op = block.ops[i]
        if op.role & _UPDATE_ROLES:
            update.add(i)
        elif OpRole.COLLECTIVE in op.role:
            consumers = [j for name in op.defined for j in readers.get(name, ())]
            if consumers and all(j in update for j in consumers):
                update.add(i)
    return update


def _check_movable(program: Program, block: Block, update: set[int]) -> None:
    """The update can run later, and only sometimes, without changing what the other ops compute."""
    written = {name for i in update for name in block.ops[i].defined}
    first, last = min(update), max(update)
    for i, op in enumerate(block.ops):
        if i in update:
            continue
        reads = block_reads(program, op)
        conditional = [n for n in reads if n in written and program.var(n).kind is VarKind.TEMP]
        if conditional:
            raise PassError(f"gradient_merge: op {op.name!r} ({op.type}) reads {conditional[0]!r}, which the "
                            "optimizer update computes; the update only runs every k_steps steps")
        touched = (set(reads) | set(op.defined)) & written
        if first < i < last and touched:
            raise PassError(f"gradient_merge: op {op.name!r} ({op.type}) sits inside the optimizer update and uses "
                            f"{sorted(touched)[0]!r}, which the update writes; it cannot be deferred to every k steps")
    fetched = [key for key, name in program.fetches.items() if name in written]
    if fetched:
        raise PassError(f"gradient_merge: fetch {fetched[0]!r} is computed by the optimizer update, "
                        "which only runs every k_steps steps")


def _merged_inputs(program: Program, block: Block, update: set[int]) -> list[str]:
    """Temporaries the update reads but the per-step ops compute: the values to accumulate, in first-read order."""
    inside = {name for i in update for name in block.ops[i].defined}
    merged: list[str] = []
    for i in sorted(update):
        for name in block_reads(program, block.ops[i]):
            var = program.var(name)
            if var.kind is VarKind.TEMP and name not in inside and name not in merged:
                if var.shape is None or not var.torch_dtype.is_floating_point:
                    raise PassError(f"gradient_merge: the update op {block.ops[i].name!r} reads {name!r} "
                                    f"({var.dtype}), which is computed every step but cannot be summed across steps")
                merged.append(name)
    return merged


def _latched_feeds(program: Program, block: Block, update: set[int]) -> list[str]:
    """Fed "momentum buffer is fresh" flags (one per parameter) the update reads.

    The runtime feeds True while torch.optim would find no momentum buffer, but fleetc creates the
    buffer on the first micro-step: by the k-th the flag reads False although no update ran yet.
    A latch remembers the flag until the update has consumed it.
    """
    feeds = program.metadata.get("optimizer", {}).get("feeds", ())
    flags = [feed["var"] for feed in feeds if "absent" in feed]
    return [f for f in flags if any(f in block_reads(program, block.ops[i]) for i in update)]


class _Builder:
    """Creates the pass's Vars and ops with the standard attributes."""

    def __init__(self, program: Program):
        self.program = program

    def var(self, base: str, shape: tuple | None, dtype: str, device: str, kind: VarKind) -> str:
        """A new Var of the global block: the update block's parent, so both see it."""
        name = self.program.unique_name(base)
        self.program.global_block.add_var(Var(name, shape, dtype, device, kind))
        return name

    def op(self, base: str, op_type: str, args: tuple, outputs: list[str], role: OpRole, module_path: str) -> Op:
        return Op(self.program.unique_name(base), op_type, args, outputs=outputs,
                  attrs={"op_role": int(role), "module_path": module_path, "provenance": PROVENANCE})


class GradientMerge:
    name = "gradient_merge"
    enabled_by = 'gradient_merge'
    summary = "accumulate gradients every step; update in a conditional block every k_steps steps"
    reads: tuple[str, ...] = ("gradient_merge", "gradient_merge_configs.k_steps", "gradient_merge_configs.avg")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        k_steps, avg = config.gradient_merge_configs.k_steps, config.gradient_merge_configs.avg
        report = PassReport(self.name)
        if pipelined(program, config):
            report.skipped_reason = (f"pipeline: each stage keeps its gradient sums over {k_steps} step() calls and "
                                     "updates on the last (k_steps multiplies the update interval; pipeline_split)")
            return program, report
        ps = ps_metadata(program)
        if ps is not None and ps["mode"] != "geo":
            report.skipped_reason = (f"parameter-server {ps['mode']} mode: the servers run the update, so the "
                                     f"worker's ps_push merges the gradients and sends them every {k_steps} steps "
                                     "(parameter_server pass)")
            return program, report
        block = program.global_block
        update = update_op_indices(program, block)
        if not update:
            report.skipped_reason = ("the Program has no optimizer update (an evaluation Program, or compiled with "
                                     "optimizer=None, where gradients already accumulate in p.grad)")
            return program, report
        _check_movable(program, block, update)
        merged = _merged_inputs(program, block, update)
        latched = _latched_feeds(program, block, update)
        build = _Builder(program)
        definer = {name: op for i, op in enumerate(block.ops) if i not in update for name in op.defined}

        accumulator = {}
        for name in merged:
            var = program.var(name)
            accumulator[name] = build.var(f"{name}@MERGE", var.shape, var.dtype, var.device, VarKind.ACCUMULATOR)
        latch = {flag: build.var(f"{flag}@MERGE", (), "bool", "cpu", VarKind.COUNTER) for flag in latched}
        step = build.var("gradient_merge@step", (), "int64", "cpu", VarKind.COUNTER)
        ready = build.var("gradient_merge@update", (), "bool", "cpu", VarKind.TEMP)

        sub = program.new_block(block.idx)
        sub.ops = self._update_block_ops(build, block, sub, update, accumulator, latch, definer, k_steps, avg)
        trigger = [
            build.op("gradient_merge.advance", "fleetc.advance_cycle", (Ref(step), k_steps), [step],
                     OpRole.OPTIMIZE, ""),
            build.op("gradient_merge.ready", "aten.eq.Scalar", (Ref(step), 0), [ready], OpRole.OPTIMIZE, ""),
            *(build.op(f"{flag}.latch", "fleetc.latch", (Ref(latch[flag]), Ref(flag)), [latch[flag]],
                       OpRole.OPTIMIZE, "") for flag in latched),
        ]
        conditional = build.op("gradient_merge.update", "fleetc.conditional_block", (Ref(ready),), [],
                               OpRole.OPTIMIZE, "")
        conditional.attrs["sub_block"] = sub.idx

        ops: list[Op] = []
        for i, op in enumerate(block.ops):
            if i not in update:
                ops.append(op)
                ops += [build.op(f"{name}.accumulate", "fleetc.accumulate", (Ref(accumulator[name]), Ref(name)),
                                 [accumulator[name]], OpRole.BACKWARD, op.module_path)
                        for name in op.defined if name in accumulator]
            if i == max(update):
                ops += [*trigger, conditional]
        block.ops = ops

        program.metadata["gradient_merge"] = {"k_steps": k_steps, "avg": avg, "update_block": sub.idx,
                                              "step": step, "accumulators": dict(accumulator)}
        report.changed = True
        report.stats = {"k_steps": k_steps, "accumulators": len(accumulator), "update_ops_moved": len(update)}
        report.notes.append(f"the update runs every {k_steps} steps on the {'mean' if avg else 'sum'} "
                            "of the merged gradients")
        return program, report

    @staticmethod
    def _update_block_ops(build: _Builder, block: Block, sub: Block, update: set[int], accumulator: dict[str, str],
                          latch: dict[str, str], definer: dict[str, Op], k_steps: int, avg: bool) -> list[Op]:
        """Average the accumulators, run the update on them, then reset accumulators and latches."""
        program = build.program
        ops = []
        if avg:
            ops += [build.op(f"{acc}.average", "fleetc.divide", (Ref(acc), float(k_steps)), [acc],
                             OpRole.OPTIMIZE, definer[name].module_path) for name, acc in accumulator.items()]
        for i in sorted(update):
            op = block.ops[i]
            program.rename_reads(op, {**accumulator, **latch})  # AMP's skip-on-overflow block reads them too
            for name in op.defined:
                if block.vars.get(name) is not None and block.vars[name].kind is VarKind.TEMP:
                    sub.add_var(block.vars.pop(name))
            if op.sub_block is not None:
                program.blocks[op.sub_block].parent_idx = sub.idx
            ops.append(op)
        ops += [build.op(f"{acc}.zero", "fleetc.zero", (Ref(acc),), [acc], OpRole.OPTIMIZE,
                         definer[name].module_path) for name, acc in accumulator.items()]
        ops += [build.op(f"{flag}.zero", "fleetc.zero", (Ref(flag),), [flag], OpRole.OPTIMIZE, "")
                for flag in latch.values()]
        return ops
