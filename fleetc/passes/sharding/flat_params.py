"""Stage 3 on flat buckets: every parameter bucket is split evenly across the ranks, and a rank holds only its piece.

The parameters are laid out in buckets of `segment_broadcast_MB` (plan.FlatBucket: one after another in declaration
order, padded to `segment × degree`; the updated parameters first, then those without an update, so a gradient
bucket never has a hole). Rank r holds elements [r·segment, (r+1)·segment) of each bucket: a parameter may be cut
between ranks, and its Var on this rank becomes its 1-D piece (`metadata["sharding"]["param_pieces"]`), updated
with a gradient piece and optimizer state of the piece's size (`state_pieces`). A rank whose range is all padding
in a bucket holds nothing of it and sends zeros.

The same buckets carry the gradients: the data-parallel gradient buckets are regrouped by parameter bucket, so each
bucket's reduce-scatter leaves this rank exactly the gradient of its piece. The gathers before each phase's uses
are passes/sharding/param_sharding.py's, with this layout (`flat_parameter_plan`).
"""
from __future__ import annotations

from fleetc.errors import PassStrategyError
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, OpRole, Program, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.allreduce import allreduce_ops
from fleetc.passes.data_parallel.bucketing import MB, plan_buckets
from fleetc.passes.data_parallel.common import ALLOC, START, WAIT, var_numel
from fleetc.passes.sharding.flat_sharding import _narrow_gradient, flat_refusal
from fleetc.passes.sharding.param_sharding import Gather, GatherPlan
from fleetc.passes.sharding.plan import FlatBucket

GRAD = "@GRAD"


def parameter_buckets(program: Program, degree: int, segment_mb: float, updated: set[str],
                      stamped: list[list[str]] | None = None) -> list[FlatBucket]:
    """The flat parameter buckets: `stamped` (the training Program's, for a later Program of the same model), else
    the parameters in declaration order, updated ones first, grouped by dtype at `segment_mb` each."""
    params = [v for v in program.persistables() if v.kind is VarKind.PARAM]
    sizes = {v.name: var_numel(v) for v in params}
    if stamped is not None:
        laid_out = {name for bucket in stamped for name in bucket}
        differ = sorted(laid_out ^ sizes.keys())
        if differ:
            raise PassStrategyError(f"sharding_configs.stage 3: this Program's parameters differ from the training "
                                f"step's flat layout ({differ[0]!r} is in only one of them); evaluate the same model")
        return [FlatBucket.of(bucket, sizes, degree) for bucket in stamped]
    cap = segment_mb * MB
    buckets = []
    for group in ([v for v in params if v.name in updated], [v for v in params if v.name not in updated]):
        planned = plan_buckets([(v.name, v.dtype, v.nbytes()) for v in group], cap, cap, len(group))
        buckets += [FlatBucket.of(bucket.grads, sizes, degree) for bucket in planned]
    return buckets


def flat_parameter_plan(buckets: list[FlatBucket], rank: int, degree: int) -> GatherPlan:
    """Each phase gathers every bucket holding a parameter it reads, in the order of their first use."""
    partial = partial_pieces(buckets, rank)

    def plan(order: list[str]) -> list[Gather]:
        position = {p: i for i, p in enumerate(order)}
        used = sorted((b for b in buckets if position.keys() & set(b.names)),
                      key=lambda b: min(position[p] for p in b.names if p in position))
        return [Gather(b.names, tuple(name for name, _, _ in b.pieces(rank)), tuple(b.starts), b.segment, degree,
                       frozenset(name for name, _, _ in b.pieces(rank)) - partial.keys())
                for b in used]
    return plan


def partial_pieces(buckets: list[FlatBucket], rank: int) -> dict[str, tuple[int, int]]:
    """Parameter → [lo, hi) of the flattened parameter this rank holds, for those it holds only part of."""
    return {name: (lo, hi) for bucket in buckets for name, lo, hi in bucket.pieces(rank)
            if (lo, hi) != (0, bucket.numels[bucket.names.index(name)])}


def averaged_gradients(program: Program) -> set[str]:
    """The gradients the data-parallel passes average (the outputs of their waits)."""
    return {g for op in program.global_block.ops if op.type == WAIT for g in op.outputs}


def flat_params_refusal(program: Program, updates: dict[int, list[Op]]) -> str | None:
    """Why a training Program's parameters cannot be held in flat pieces (None: they can): stage 2's reasons
    (flat_sharding.py), or an updated parameter whose gradient no data-parallel bucket averages."""
    params = list(dict.fromkeys(op.attrs["param"] for ops in updates.values() for op in ops))
    refusal = flat_refusal(program, updates, [params], params)
    if refusal is None and any(p + GRAD not in averaged_gradients(program) for p in params):
        return "some updated parameter's gradient is not averaged in a bucket"
    return refusal


def regroup_gradients(program: Program, buckets: list[FlatBucket], updated: set[str],
                      report: PassReport) -> dict[tuple[str, ...], FlatBucket]:
    """Replace the data-parallel gradient buckets by one per parameter bucket (its updated parameters' gradients,
    in bucket order: consecutive, since updated parameters come first),
    issued after its last gradient is produced and waited for before the next one is issued or a gradient of it is
    read. Returns each new bucket's parameters → the parameter bucket it packs into."""
    block = program.global_block
    starts = [op for op in block.ops if op.type == START]
    waits = {op.args[1].name: op for op in block.ops if op.type == WAIT}
    reduced = averaged_gradients(program)
    removed = {op.name for s in starts for op in (s, waits[s.outputs[0]])}
    removed |= {op.name for op in block.ops if op.type == ALLOC and op.outputs[0] in {s.args[0].name for s in starts}}
    comm, algorithm = starts[0].args[3], starts[0].args[4]
    for start in starts:
        del block.vars[start.args[0].name], block.vars[start.outputs[0]]
    kept = [op for op in block.ops if op.name not in removed]
    definer = {name: i for i, op in enumerate(kept) for name in op.defined}
    issue_after: dict[int, list[Op]] = {}
    layouts: dict[tuple[str, ...], FlatBucket] = {}
    for bucket in buckets:
        grads = [p + GRAD for p in bucket.names if p in updated and p + GRAD in reduced]
        if not grads:
            continue
        alloc, start, wait = allreduce_ops(program, grads, comm, algorithm, f"param_bucket{len(layouts)}", "sharding")
        layouts[tuple(g.removesuffix(GRAD) for g in grads)] = bucket
        issue_after.setdefault(max(definer[f"{g}@LOCAL"] for g in grads), []).extend([alloc, start, wait])
        report.count("gradient_buckets_regrouped")
    ops: list[Op] = []
    pending: list[Op] = []  # waits not placed yet
    for index, op in enumerate(kept):
        reads = set(block_reads(program, op))
        if any(reads.intersection(w.outputs) for w in pending) or OpRole.OPTIMIZE in op.role:
            ops += pending
            pending = []
        ops.append(op)
        for new in issue_after.get(index, ()):
            if new.type == ALLOC:
                ops += pending  # at most one bucket in flight
                pending = []
            (pending if new.type == WAIT else ops).append(new)
    block.ops = ops + pending
    return layouts


def flat_layout(bucket: FlatBucket, names: list[str], rank: int, degree: int) -> tuple[list[int], int, int, list[str]]:
    """(starts, segment, padding, the parameters this rank has a piece of) of the gradients `names` of a parameter
    bucket, for the reduce-scatter (optimizer_sharding.py's `_reduce_scatter`)."""
    start_of = dict(zip(bucket.names, bucket.starts))
    mine = [name for name, _, _ in bucket.pieces(rank) if name in names]
    return [start_of[n] for n in names], bucket.segment, bucket.padding(degree), mine


def narrow_updates(program: Program, updates: dict[int, list[Op]], partial: dict[str, tuple[int, int]],
                   report: PassReport) -> None:
    """Each kept update of a parameter this rank holds part of reads its piece: the gradient piece (a view of the
    shard) and optimizer state of the piece's size (`state_pieces`); the parameter's own Var becomes the piece."""
    bindings = program.metadata.get("state_bindings", {})
    state_pieces = program.metadata.setdefault("state_pieces", {})
    for block_idx, ops in updates.items():
        for op in [op for op in ops if op in program.blocks[block_idx].ops and op.attrs["param"] in partial]:
            param = op.attrs["param"]
            lo, hi = partial[param]
            whole = tuple(program.var(param).shape)
            _narrow_gradient(program, param + GRAD, hi - lo)  # and what AMP derives from it (use_pure_fp16's unscaling)
            for name in op.inputs:
                state = program.find_var(name)
                if state is not None and state.kind is VarKind.OPTIMIZER_STATE and \
                        bindings.get(name, [None])[0] == param and tuple(state.shape or ()) == whole:
                    state.shape = (hi - lo,)
                    state_pieces[name] = [lo, hi]
            report.count("params_split")
