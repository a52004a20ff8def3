"""Stage 2 on flat buckets: each gradient bucket is split evenly across the ranks, so a parameter may be split.

A bucket's gradients lie one after another in a buffer padded to `segment × degree` (plan.FlatBucket); the
reduce-scatter leaves rank r the averaged elements [r·segment, (r+1)·segment). For each parameter that range
covers, the rank updates only those elements: the update reads a 1-D slice of the flattened parameter (a view,
`<param>@PIECE`, so the update writes the parameter itself), the gradient piece (a view of the shard) and
optimizer state of the piece's size (`program.metadata["state_pieces"]`: state Var → [lo, hi), which the runtime
uses to keep only that slice of `optimizer.state`). After the updates each bucket's parameters are all-gathered
through the same flat layout. A rank whose range is all padding in a bucket sends zeros and updates nothing there.

Only where every update is elementwise (`fleetc.sgd`, `fleetc.adam`) and no pass reads whole gradients first (AMP's
overflow check, gradient clipping, gradient merge); otherwise `flat_refusal` says why and stage 2 owns whole
parameters (passes/sharding/plan.py's `assign_owners`).
"""
from __future__ import annotations

from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.common import var_numel
from fleetc.passes.data_parallel.merged import merged_values
from fleetc.passes.sharding.plan import FlatBucket

ELEMENTWISE_UPDATES = ("fleetc.sgd", "fleetc.adam")
WHOLE_GRADIENT_READERS = ("fleetc.check_finite_and_unscale", "fleetc.squared_global_norm", "fleetc.clip_by_norm",
                          "fleetc.clip_by_value", "fleetc.clip_by_global_norm")


def flat_refusal(program: Program, updates: dict[int, list[Op]], buckets: list[list[str]],
                 params: list[str]) -> str | None:
    """Why the buckets cannot be split evenly (None: they can)."""
    if merged_values(program):
        return "gradient merge keeps whole accumulators"
    kinds = {op.type for _, op in program.walk_ops()}
    readers = kinds.intersection(WHOLE_GRADIENT_READERS)
    if readers:
        return f"{min(readers)} reads whole gradients"
    other = {op.type for ops in updates.values() for op in ops} - set(ELEMENTWISE_UPDATES)
    if other:
        return f"the update {min(other)} is not elementwise"
    if set(params) - {p for bucket in buckets for p in bucket}:
        return "some updated parameter has no gradient bucket"
    return None


def piece_updates(program: Program, updates: dict[int, list[Op]], pieces: dict[str, tuple[int, int]],
                  report: PassReport) -> None:
    """Narrow each kept update of a split parameter to its piece: the parameter's slice view, the gradient piece
    (its Var reshaped; the reduce-scatter's views define it), state Vars of the piece's size."""
    bindings = program.metadata.get("state_bindings", {})
    state_pieces = program.metadata.setdefault("state_pieces", {})
    for block_idx, ops in updates.items():
        block = program.blocks[block_idx]
        for op in [op for op in ops if op in block.ops]:
            param = op.attrs["param"]
            var = program.var(param)
            lo, hi = pieces[param]
            if (lo, hi) == (0, var_numel(var)):
                continue
            flat = block.add_var(Var(program.unique_name(f"{param}@FLAT"), (var_numel(var),), var.dtype, var.device))
            piece = block.add_var(Var(program.unique_name(f"{param}@PIECE"), (hi - lo,), var.dtype, var.device))
            attrs = {"op_role": int(OpRole.OPTIMIZE), "provenance": "sharding"}
            views = [Op(program.unique_name(f"{param}_flat"), "aten.view.default", (Ref(param), [-1]), {},
                        [flat.name], dict(attrs)),
                     Op(program.unique_name(f"{param}_piece"), "aten.slice.Tensor", (Ref(flat.name), 0, lo, hi), {},
                        [piece.name], dict(attrs))]
            program.var(f"{param}@GRAD").shape = (hi - lo,)
            op.args = tuple(Ref(piece.name) if isinstance(a, Ref) and a.name == param else a for a in op.args)
            for name in op.inputs:
                state = program.find_var(name)
                if state is not None and state.kind is VarKind.OPTIMIZER_STATE and bindings.get(name, [None])[0] == \
                        param and state.shape and tuple(state.shape) == tuple(var.shape):
                    state.shape = (hi - lo,)
                    state_pieces[name] = [lo, hi]
            index = block.ops.index(op)
            block.ops[index:index] = views
            report.count("params_split")


def rank_pieces(buckets: list[FlatBucket], rank: int) -> dict[str, tuple[int, int]]:
    """Parameter → the [lo, hi) of its flattened elements this rank updates (parameters it has no piece of: absent)."""
    return {name: (lo, hi) for bucket in buckets for name, lo, hi in bucket.pieces(rank)}


def flat_gathers(program: Program, buckets: list[FlatBucket], report: PassReport) -> list[Op]:
    """One all-gather per flat bucket after the updates: every rank ends the step with every parameter whole."""
    ops = []
    for bucket in buckets:
        label = program.unique_name(f"shard_gather{report.stats.get('gather_buckets', 0)}")
        ops.append(Op(label, "fleetc.c_sharding_allgather",
                      ([Ref(p) for p in bucket.names], bucket.starts, bucket.segment, "sharding", label), {},
                      list(bucket.names), {"op_role": int(OpRole.COLLECTIVE), "provenance": "sharding"}))
        report.count("gather_buckets")
    return ops
