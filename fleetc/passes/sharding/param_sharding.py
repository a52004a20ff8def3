"""ZeRO stage 3 as a rewrite: each rank holds only its part of the parameters, all-gathered where they are used.

Two layouts of that part (a `GatherPlan` says which): flat buckets split evenly across the ranks (the default,
passes/sharding/flat_params.py: a rank holds a flat piece of some parameters) or whole-parameter ownership (where
flat pieces do not apply: every parameter has one owner, passes/sharding/plan.py, over all parameters, so a
forward-only Program shards them exactly as the training Program does). The step has two phases, forward (up to
the first backward op) and backward (the rest, recompute's replays included). In each phase the parameters are
gathered in buckets, in the order of their first use there: a bucket's `fleetc.c_sharding_param_gather_start`
packs what this rank holds of it into its segment and issues the all-gather; its `_wait`, right before the
bucket's first use, returns the gathered buffer; `fleetc.gathered_params` views the parameters this rank does not
hold whole out of it (`<param>@FULL` forward, `<param>@FULL_BW` backward). The runtime frees those views, and
with them the buffer, after their last use; the backward gathers again. The Var of a parameter this rank holds
nothing of is removed: it holds no copy of it between steps.

Prefetch: bucket i+1's gather is issued right after bucket i's wait, so it is in flight while bucket i's
ops run (compiler-based FSDP's order; each decision is an op in the Program, visible in dump-ir). The
backward's first bucket is issued right after the forward's last bucket's wait, so it is in flight during the
end of the forward, the loss and the backward's first ops: at most two gathered buckets are live at a time
(the one in use and the one prefetched) there as everywhere else.
A forward view of a parameter that the backward reads (the transposed weight saved for the backward) is
replayed in the backward from the backward's gather, so nothing gathered in the forward outlives it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Gather:
    """One bucket's all-gather: the parameters it brings whole, laid out at `starts` in a buffer of `segment`
    elements per rank; this rank packs its Vars `sources` (whole parameters or flat pieces of them) consecutively
    at the start of its segment; `local`: parameters this rank holds whole already (read as they are)."""

    names: tuple[str, ...]
    sources: tuple[str, ...]
    starts: tuple[int, ...]
    segment: int
    ranks: int
    local: frozenset[str]


# Given the parameters a phase reads, in the order of their first use there: the gathers bringing them, in issue order.
GatherPlan = Callable[[list[str]], list[Gather]]


def whole_parameter_plan(program: Program, owners: dict[str, int], degree: int, rank: int, config: Any) -> GatherPlan:
    """Whole-parameter ownership: each phase's parameters in buckets of `segment_broadcast_MB` by first use,
    owner-major."""
    cap = config.sharding_configs.segment_broadcast_MB * MB
    sizes = {p: var_numel(program.var(p)) for p in owners}

    def plan(order: list[str]) -> list[Gather]:
        position = {p: i for i, p in enumerate(order)}
        buckets = plan_buckets([(p, program.var(p).dtype, program.var(p).nbytes()) for p in order], cap, cap,
                               len(order))
        buckets.sort(key=lambda b: min(position[p] for p in b.grads))
        gathers = []
        for bucket in buckets:
            sharded = ShardedBucket.of(sorted(bucket.grads, key=position.__getitem__), owners, sizes, degree)
            starts = owner_major_starts([sizes[p] for p in sharded.names], list(sharded.owners), sharded.segment)
            mine = sharded.owned_by(rank)
            gathers.append(Gather(sharded.names, tuple(mine), tuple(starts), sharded.segment, degree, frozenset(mine)))
        return gathers
    return plan


def shard_parameters(program: Program, params: set[str], plan: GatherPlan, dropped: set[str],
                     report: PassReport) -> None:
    """Gather the parameters before their uses in each phase (`plan` lays the buckets out), and drop this rank's
    Vars of `dropped` (parameters it holds no part of)."""
    block = program.global_block
    first_backward = next((i for i, op in enumerate(block.ops) if OpRole.BACKWARD in op.role), len(block.ops))
    _replay_parameter_views(program, block, params, first_backward, report)
    phases = [(0, first_backward), (first_backward, len(block.ops))]
    inserts: dict[int, list[Op]] = {}
    previous_wait: list[Op] | None = None  # carried into the backward: its first bucket is prefetched too
    for (suffix, role), (lo, hi) in zip(_PHASES, phases):
        first_use: dict[str, int] = {}
        for index in range(lo, hi):
            if OpRole.OPTIMIZE in block.ops[index].role:
                continue  # an owner's update reads its own parameter
            for name in block_reads(program, block.ops[index]):
                if name in params:
                    first_use.setdefault(name, index)
        if not first_use:
            continue
        order = sorted(first_use, key=lambda p: (first_use[p], p))
        renames: dict[str, str] = {}
        for gather in plan(order):
            at = min(first_use[p] for p in gather.names if p in first_use)
            start, wait = gather_bucket(program, block, gather, [p for p in gather.names if p in first_use], suffix,
                                        role, renames, report)
            # prefetch: issued right after the previous bucket's views, so it overlaps that bucket's compute (the
            # backward's first bucket: right after the forward's last, overlapping it, the loss and the first grads)
            (previous_wait if previous_wait is not None else inserts.setdefault(at, [])).append(start)
            inserts.setdefault(at, []).extend(wait)
            previous_wait = inserts[at]
        for index in range(lo, hi):
            if OpRole.OPTIMIZE not in block.ops[index].role:
                program.rename_reads(block.ops[index], renames)
    block.ops = [new for index, op in enumerate(block.ops) for new in [*inserts.get(index, ()), op]]
    _drop_foreign(program, block, dropped)


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


def gather_bucket(program: Program, block: Block, gather: Gather, used: list[str], suffix: str, role: OpRole,
            renames: dict[str, str], report: PassReport) -> tuple[Op, list[Op]]:
    """The ops gathering one bucket: the start, and the wait plus the views of the `used` parameters this rank does
    not hold whole."""
    first = program.var(gather.names[0])
    label = program.unique_name(f"param_gather{report.stats.get('param_gather_buckets', 0)}")
    report.count("param_gather_buckets")
    work = block.add_var(Var(program.unique_name(f"{label}@WORK"), None, "work", first.device))
    flat = block.add_var(Var(program.unique_name(f"{label}@GATHERED"), (gather.segment * gather.ranks,),
                             first.dtype, first.device))
    attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": "sharding",
             "module_path": common_module(program, list(gather.names))}
    start = Op(program.unique_name(f"{label}_start"), GATHER_START,
               ([Ref(p) for p in gather.sources], gather.segment, first.torch_dtype, first.device, GROUP, label),
               {}, [work.name], dict(attrs))
    wait = Op(program.unique_name(f"{label}_wait"), GATHER_WAIT, (Ref(work.name),), {}, [flat.name], dict(attrs))
    starts = dict(zip(gather.names, gather.starts))
    viewed = [p for p in used if p not in gather.local]
    if not viewed:
        return start, [wait]
    for p in viewed:
        var = program.var(p)
        renames[p] = block.add_var(Var(program.unique_name(p + suffix), var.shape, var.dtype, var.device)).name
    views = Op(program.unique_name(f"{label}_params"), GATHERED_VIEWS,
               (Ref(flat.name), [starts[p] for p in viewed], [list(program.var(p).shape) for p in viewed]),
               {}, [renames[p] for p in viewed],
               {"op_role": int(role), "provenance": "sharding", "module_path": attrs["module_path"]})
    report.count("gathered_param_views", len(viewed))
    return start, [wait, views]


def gathered_buffer_bytes(program: Program) -> list[int]:
    """The bytes of each buffer `program` gathers whole (each gather wait's output, padded), in op order: what
    stage 3 holds in flight beside a rank's pieces."""
    return [program.var(op.outputs[0]).nbytes() for _, op in program.walk_ops() if op.type == GATHER_WAIT]


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
