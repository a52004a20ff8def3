"""ZeRO stage 3 as a rewrite: parameters live only on their owners, and are all-gathered where they are used.

Every parameter of the Program has one owner (whole-parameter ownership, passes/sharding/plan.py, over
all parameters, so a forward-only Program shards them exactly as the training Program does). The step has
two phases, forward (up to the first backward op) and backward (the rest, recompute's replays included).
In each phase the parameters are gathered in buckets of `segment_broadcast_MB`, in the order of their
first use there: a bucket's `fleetc.c_sharding_param_gather_start` packs the owned parameters into this
rank's segment and issues the all-gather; its `_wait`, right before the bucket's first use, returns the
gathered owner-major buffer; `fleetc.gathered_params` views the foreign parameters out of it
(`<param>@FULL` forward, `<param>@FULL_BW` backward). The runtime frees those views, and with them the
buffer, after their last use; the backward gathers again. A foreign parameter's own Var is removed: this
rank holds no copy of it between steps.

Prefetch: bucket i+1's gather is issued right after bucket i's wait, so it is in flight while bucket i's
ops run (compiler-based FSDP's order; each decision is an op in the Program, visible in dump-ir). The
backward's first bucket is issued right after the forward's last bucket's wait, so it is in flight during the
end of the forward, the loss and the backward's first ops: at most two gathered buckets are live at a time
(the one in use and the one prefetched) there as everywhere else.
A forward view of a parameter that the backward reads (the transposed weight saved for the backward) is
replayed in the backward from the backward's gather, so nothing gathered in the forward outlives it.
"""
from __future__ import annotations

from typing import Any

from fleetc.comm.sharding_ops import owner_major_starts
from fleetc.errors import StrategyError
from fleetc.ir.liveness import aliased_input, block_reads
from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.data_parallel.bucketing import MB, plan_buckets
from fleetc.passes.data_parallel.common import common_module, var_numel
from fleetc.passes.sharding.plan import ShardedBucket, assign_owners

GATHER_START = "fleetc.c_sharding_param_gather_start"
GATHER_WAIT = "fleetc.c_sharding_param_gather_wait"
GATHERED_VIEWS = "fleetc.gathered_params"
GROUP = "sharding"
_PHASES = (("@FULL", OpRole.FORWARD), ("@FULL_BW", OpRole.BACKWARD))


def parameter_owners(program: Program, degree: int) -> dict[str, int]:
    """Owner of every parameter of the Program (training and forward-only Programs of a model agree)."""
    sizes = {v.name: var_numel(v) for v in program.persistables() if v.kind is VarKind.PARAM}
    return assign_owners(sizes, degree)


def shard_parameters(program: Program, owners: dict[str, int], degree: int, rank: int, config: Any,
                     report: PassReport) -> None:
    """Gather the parameters before their uses in each phase, and drop this rank's copies of foreign ones."""
    block = program.global_block
    sizes = {p: var_numel(program.var(p)) for p in owners}
    first_backward = next((i for i, op in enumerate(block.ops) if OpRole.BACKWARD in op.role), len(block.ops))
    _replay_parameter_views(program, block, set(owners), first_backward, report)
    phases = [(0, first_backward), (first_backward, len(block.ops))]
    cap = config.sharding_configs.segment_broadcast_MB * MB
    inserts: dict[int, list[Op]] = {}
    previous_wait: list[Op] | None = None  # carried into the backward: its first bucket is prefetched too
    for (suffix, role), (lo, hi) in zip(_PHASES, phases):
        first_use: dict[str, int] = {}
        for index in range(lo, hi):
            if OpRole.OPTIMIZE in block.ops[index].role:
                continue  # an owner's update reads its own parameter
            for name in block_reads(program, block.ops[index]):
                if name in owners:
                    first_use.setdefault(name, index)
        if not first_use:
            continue
        order = sorted(first_use, key=lambda p: (first_use[p], p))
        buckets = plan_buckets([(p, program.var(p).dtype, program.var(p).nbytes()) for p in order], cap, cap,
                               len(order))
        buckets.sort(key=lambda b: min(first_use[p] for p in b.grads))
        renames: dict[str, str] = {}
        for bucket in buckets:
            names = sorted(bucket.grads, key=lambda p: first_use[p])
            at = min(first_use[p] for p in names)
            start, wait = _gather(program, block, ShardedBucket.of(names, owners, sizes, degree), degree, rank,
                                  suffix, role, renames, report)
            # prefetch: issued right after the previous bucket's views, so it overlaps that bucket's compute (the
            # backward's first bucket: right after the forward's last, overlapping it, the loss and the first grads)
            (previous_wait if previous_wait is not None else inserts.setdefault(at, [])).append(start)
            inserts.setdefault(at, []).extend(wait)
            previous_wait = inserts[at]
        for index in range(lo, hi):
            if OpRole.OPTIMIZE not in block.ops[index].role:
                program.rename_reads(block.ops[index], renames)
    block.ops = [new for index, op in enumerate(block.ops) for new in [*inserts.get(index, ()), op]]
    _drop_foreign(program, block, {p for p, owner in owners.items() if owner != rank})


def _replay_parameter_views(program: Program, block: Block, params: set[str], first_backward: int,
                            report: PassReport) -> None:
    """Backward reads of forward views of parameters (the transposed weight saved for the backward) read a replay
    of the view chain in the backward instead, so the backward's own gather feeds them and the forward's gathered
    buffer dies after the forward. Done for every parameter, owned or not, so every rank gathers alike."""
    chains: dict[str, Op] = {}  # forward view of a parameter (or of such a view) → the op making it
    for op in block.ops[:first_backward]:
        if len(op.defined) == 1 and len(op.inputs) == 1 and op.inputs[0] in params | chains.keys() \
                and aliased_input(op, 0) == op.inputs[0]:
            chains[op.defined[0]] = op
    replayed: dict[str, str] = {}
    ops = list(block.ops[:first_backward])
    for op in block.ops[first_backward:]:
        if OpRole.OPTIMIZE not in op.role:
            for name in block_reads(program, op):
                if name in chains:
                    ops.extend(_replay(program, block, name, chains, replayed, report))
            program.rename_reads(op, replayed)
        ops.append(op)
    block.ops = ops


def _replay(program: Program, block: Block, name: str, chains: dict[str, Op], replayed: dict[str, str],
            report: PassReport) -> list[Op]:
    """The ops recomputing forward view `name` (and the views it is made from) in the backward, first time only."""
    if name in replayed:
        return []
    view = chains[name]
    ops = _replay(program, block, view.inputs[0], chains, replayed, report) if view.inputs[0] in chains else []
    var = block.vars[name]
    replayed[name] = block.add_var(Var(program.unique_name(f"{name}@BW"), var.shape, var.dtype, var.device)).name
    copy = Op(program.unique_name(f"{view.name}_bw"), view.type, view.args, dict(view.kwargs), [replayed[name]],
              {**view.attrs, "op_role": int(OpRole.BACKWARD), "provenance": "sharding"})
    copy.rename_inputs(replayed)
    report.count("views_replayed_in_backward")
    return [*ops, copy]


def _gather(program: Program, block: Block, bucket: ShardedBucket, degree: int, rank: int, suffix: str,
            role: OpRole, renames: dict[str, str], report: PassReport) -> tuple[Op, list[Op]]:
    """The ops gathering one bucket: the start, and the wait plus the views of the foreign parameters."""
    first = program.var(bucket.names[0])
    numels = [var_numel(program.var(p)) for p in bucket.names]
    label = program.unique_name(f"param_gather{report.stats.get('param_gather_buckets', 0)}")
    report.count("param_gather_buckets")
    work = block.add_var(Var(program.unique_name(f"{label}@WORK"), None, "work", first.device))
    flat = block.add_var(Var(program.unique_name(f"{label}@GATHERED"), (bucket.segment * degree,), first.dtype,
                             first.device))
    attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": "sharding",
             "module_path": common_module(program, list(bucket.names))}
    start = Op(program.unique_name(f"{label}_start"), GATHER_START,
               ([Ref(p) for p in bucket.owned_by(rank)], bucket.segment, first.torch_dtype, first.device, GROUP, label),
               {}, [work.name], dict(attrs))
    wait = Op(program.unique_name(f"{label}_wait"), GATHER_WAIT, (Ref(work.name),), {}, [flat.name], dict(attrs))
    starts = dict(zip(bucket.names, owner_major_starts(numels, list(bucket.owners), bucket.segment)))
    foreign = [p for p, owner in zip(bucket.names, bucket.owners) if owner != rank]
    if not foreign:
        return start, [wait]
    for p in foreign:
        var = program.var(p)
        renames[p] = block.add_var(Var(program.unique_name(p + suffix), var.shape, var.dtype, var.device)).name
    views = Op(program.unique_name(f"{label}_params"), GATHERED_VIEWS,
               (Ref(flat.name), [starts[p] for p in foreign], [list(program.var(p).shape) for p in foreign]), {},
               [renames[p] for p in foreign],
               {"op_role": int(role), "provenance": "sharding", "module_path": attrs["module_path"]})
    report.count("gathered_param_views", len(foreign))
    return start, [wait, views]


def _drop_foreign(program: Program, block: Block, foreign: set[str]) -> None:
    """Remove the foreign parameters' Vars; an op still reading one would need a gather this pass did not place."""
    for _, op in program.walk_ops():
        stale = foreign.intersection(op.inputs)
        if stale:
            raise StrategyError(f"sharding_configs.stage 3: op {op.name!r} ({op.type}) reads parameter "
                                f"{min(stale)!r}, which this rank does not hold, outside the forward and "
                                "backward phases (use stage 2 with this Program)")
    for name in foreign:
        block.vars.pop(name, None)
