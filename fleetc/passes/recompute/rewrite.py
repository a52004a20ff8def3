"""Applies a RecomputePlan: re-emits forward ops inside backward and points their readers at the fresh values."""
from __future__ import annotations

from dataclasses import dataclass

from fleetc.ir.program import Op, OpRole, Program, Ref, Var
from fleetc.passes.recompute.plan import ForwardRegion, RecomputePlan, recompute_cost
from fleetc.passes.recompute.policy import DROPOUT, RecomputePolicy

PROVENANCE = "recompute"
DROPOUT_REPLAY = "fleetc.dropout_replay"


@dataclass
class RewriteStats:
    ops_recomputed: int = 0
    dropouts_replayed: int = 0
    recompute_flops: float = 0.0


class _Namer:
    """Fresh `<name>@RECOMPUTE` names, unique in the Program (one scan of the names, not one per name)."""

    def __init__(self, program: Program):
        self.taken = {v.name for v in program.all_vars()} | {op.name for _, op in program.walk_ops()}

    def __call__(self, base: str) -> str:
        name, i = f"{base}@RECOMPUTE", 1
        while name in self.taken:
            name, i = f"{base}@RECOMPUTE_{i}", i + 1
        self.taken.add(name)
        return name


def _recomputed_op(region: ForwardRegion, op: Op, renamed: dict[str, str], namer: _Namer) -> Op:
    """A backward-role copy of forward `op` reading recomputed values; dropout replays its saved mask.

    Like captured ops, the copy is named after its first result (`addmm@RECOMPUTE`).
    """
    attrs = {**op.attrs, "op_role": int(OpRole.BACKWARD), "provenance": PROVENANCE,
             "forward_op": op.name}
    if op.type == DROPOUT:
        x, p = op.args[:2]
        train = op.args[2] if len(op.args) > 2 else op.kwargs.get("train")
        new = Op(op.name, DROPOUT_REPLAY, (x, Ref(op.outputs[1]), p, train), outputs=[op.outputs[0]], attrs=attrs)
    else:
        new = Op(op.name, op.type, op.args, op.kwargs, list(op.outputs), attrs)
    new.rename_inputs(renamed)  # rebuilds the argument containers, so the forward op's are never shared mutably
    fresh = []
    for name in new.outputs:
        if name is None:
            fresh.append(None)
            continue
        var = region.program.var(name)
        renamed[name] = namer(name)
        region.block.add_var(Var(renamed[name], var.shape, var.dtype, var.device, var.kind))
        fresh.append(renamed[name])
    new.outputs = fresh
    new.name = next((n for n in fresh if n is not None), None) or namer(op.name)
    return new


def apply_plan(region: ForwardRegion, plan: RecomputePlan, policy: RecomputePolicy) -> RewriteStats:
    """Rewrite `region.program` in place so that ops after forward read only saved or recomputed values."""
    program, block = region.program, region.block
    stats = RewriteStats()
    required = region.closure(region.read_after, plan.saved)
    members: dict[int, set[str]] = {}
    for name in required:
        if name in plan.group_of:
            members.setdefault(plan.group_of[name], set()).add(name)
    renamed: dict[str, str] = {}
    emitted: set[str] = set()
    namer = _Namer(program)
    new_ops = block.ops[:region.end]
    for op in block.ops[region.end:]:
        missing = {n for n in op.inputs if n in region.producer and n not in plan.saved and n not in renamed}
        batch = _batch_for(region, plan, missing, members, emitted)
        for fwd in sorted((region.ops[region.index[n]] for n in batch), key=lambda o: region.index[o.name]):
            new_ops.append(_recomputed_op(region, fwd, renamed, namer))
            stats.ops_recomputed += 1
            stats.dropouts_replayed += fwd.type == DROPOUT
        emitted |= batch
        op.rename_inputs(renamed)
        new_ops.append(op)
    block.ops = new_ops
    stats.recompute_flops = recompute_cost(region, plan, policy)
    return stats


def _batch_for(region: ForwardRegion, plan: RecomputePlan, missing: set[str], members: dict[int, set[str]],
               emitted: set[str]) -> set[str]:
    """Forward ops to re-emit now: those making `missing`, their whole groups, and what they need in turn."""
    batch: set[str] = set()
    stack = [region.producer[n].name for n in missing]
    while stack:
        name = stack.pop()
        if name in batch or name in emitted:
            continue
        batch.add(name)
        if name in plan.group_of:
            stack += members.get(plan.group_of[name], ())
        stack += [region.producer[n].name for n in region.recompute_inputs(region.ops[region.index[name]])
                  if n not in plan.saved]
    return batch
