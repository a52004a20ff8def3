"""Stage 2 on flat buckets: each gradient bucket is split evenly across the ranks, so a parameter may be split.

A bucket's gradients lie one after another in a buffer padded to `segment × degree` (plan.FlatBucket); the
reduce-scatter leaves rank r the averaged elements [r·segment, (r+1)·segment). For each parameter that range
covers, the rank updates only those elements: the update reads a 1-D slice of the flattened parameter (a view,
`<param>@PIECE`, so the update writes the parameter itself), the gradient piece (a view of the shard) and
optimizer state of the piece's size (`program.metadata["state_pieces"]`: state Var → [lo, hi), which the runtime
uses to keep only that slice of `optimizer.state`). After the updates each bucket's parameters are all-gathered
through the same flat layout. A rank whose range is all padding in a bucket sends zeros and updates nothing there.

Only where every update is elementwise (`fleetc.sgd`, `fleetc.adam`), reads a value computed elementwise from its
averaged gradient, and nothing reads a whole gradient (per-gradient norm clipping); otherwise `flat_refusal` says
why and stage 2 owns whole parameters (passes/sharding/plan.py's `assign_owners`). What the optimize section
computes from a gradient piece elementwise (AMP's cast, unscaling and overflow check, clipping) is a piece too:
AMP's `found_inf` is then max-allreduced and global-norm clipping's squared norm summed over the sharding group
(optimizer_sharding.py, clip_sharding.py); padding is in no piece, so it adds nothing to the norm. Under
use_pure_fp16 the float32 master weight is optimizer state of the piece's size, rounded into the parameter's piece.
Under gradient merge the accumulators stay whole and are reduce-scattered once per k steps (merged_sharding.py).
"""
from __future__ import annotations

from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.common import WAIT, var_numel
from fleetc.passes.data_parallel.merged import merged_values
from fleetc.passes.sharding.merged_sharding import merged_accumulators, merged_buckets
from fleetc.passes.sharding.plan import FlatBucket

ELEMENTWISE_UPDATES = ("fleetc.sgd", "fleetc.adam")
WHOLE_GRADIENT_READERS = ("fleetc.clip_by_norm",)  # each gradient's own norm needs all of it
# ops mapping a list of gradients to a list of values one to one, elementwise: a piece in, a piece out (the squared
# global norm of the pieces is summed over the ranks: clip_sharding.py; padding is in no piece)
ELEMENTWISE_LISTS = ("fleetc.check_finite_and_unscale", "fleetc.clip_by_global_norm", "fleetc.clip_by_value")


def flat_refusal(program: Program, updates: dict[int, list[Op]], buckets: list[list[str]],
                 params: list[str]) -> str | None:
    """Why the buckets cannot be split evenly (None: they can)."""
    kinds = {op.type for _, op in program.walk_ops()}
    readers = kinds.intersection(WHOLE_GRADIENT_READERS)
    if readers:
        return f"{min(readers)} reads whole gradients"
    other = {op.type for ops in updates.values() for op in ops} - set(ELEMENTWISE_UPDATES)
    if other:
        return f"the update {min(other)} is not elementwise"
    if set(params) - {p for bucket in buckets for p in bucket}:
        return "some updated parameter has no gradient bucket"
    gradients = update_gradients(program, params)
    for op in (op for ops in updates.values() for op in ops):
        if not set(_derived_gradients(program, gradients[op.attrs["param"]])).intersection(op.inputs):
            return f"the update {op.name!r} reads no value computed from the averaged gradient"
    return None


def gradient_buckets(program: Program) -> list[list[str]]:
    """The parameters behind each gradient bucket stage 2 reduce-scatters: the per-step buckets, or under gradient
    merge the buckets of accumulators its update block allreduces."""
    if merged_values(program):
        return merged_buckets(program)
    return [[g.removesuffix("@GRAD") for g in op.outputs] for op in program.global_block.ops if op.type == WAIT]


def update_gradients(program: Program, params: list[str]) -> dict[str, str]:
    """Parameter → the averaged gradient its update is computed from (under gradient merge: its accumulator)."""
    merged = merged_accumulators(program)
    return {p: merged.get(p, f"{p}@GRAD") for p in params}


def piece_updates(program: Program, updates: dict[int, list[Op]], pieces: dict[str, tuple[int, int]],
                  gradients: dict[str, str], report: PassReport) -> None:
    """Narrow each kept update of a split parameter to its piece: the parameter's slice view, the gradient piece
    (`gradients[param]`, its Var reshaped; the reduce-scatter's views define it), state Vars of the piece's size."""
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
            narrow_gradient(program, gradients[param], hi - lo)
            op.args = tuple(Ref(piece.name) if isinstance(a, Ref) and a.name == param else a for a in op.args)
            for rounding in _master_roundings(block, op, param):  # use_pure_fp16: the master piece rounds into it
                rounding.args = (Ref(piece.name), *rounding.args[1:])
            for name in op.inputs:
                state = program.find_var(name)
                if state is not None and state.kind is VarKind.OPTIMIZER_STATE and bindings.get(name, [None])[0] == \
                        param and state.shape and tuple(state.shape) == tuple(var.shape):
                    state.shape = (hi - lo,)
                    state_pieces[name] = [lo, hi]
            index = block.ops.index(op)
            block.ops[index:index] = views
            report.count("params_split")


def _master_roundings(block: Block, update: Op, param: str) -> list[Op]:
    """use_pure_fp16's assigns after `update` that round the float32 master weight into the parameter."""
    after = block.ops[block.ops.index(update) + 1:]
    return [op for op in after if op.type == "fleetc.assign" and OpRole.OPTIMIZE in op.role and op.args[0] == Ref(param)]


def _derived_gradients(program: Program, grad: str) -> list[str]:
    """`grad` and every value the optimize section derives from it elementwise (AMP's cast and unscaling, the
    clipped gradient). Repeated until nothing is added: blocks are listed by index, not in execution order (under
    AMP × gradient merge the updates' block, nested in the merge's update block, comes before it)."""
    derived = [grad]
    added = True
    while added:
        added = False
        for _, op in program.walk_ops():
            if op.type in ELEMENTWISE_LISTS:
                pairs = zip(op.args[0], op.outputs)
            elif op.type == "aten._to_copy.default" and isinstance(op.args[0], Ref):
                pairs = [(op.args[0], op.outputs[0])]
            else:
                continue
            new = [out for ref, out in pairs if ref.name in derived and out not in derived]
            derived += new
            added = added or bool(new)
    return derived


def narrow_gradient(program: Program, grad: str, numel: int) -> None:
    """Give the gradient piece's Var, and every value derived from it elementwise, the piece's 1-D shape."""
    for name in _derived_gradients(program, grad):
        next(block.vars[name] for block in program.blocks if name in block.vars).shape = (numel,)


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
