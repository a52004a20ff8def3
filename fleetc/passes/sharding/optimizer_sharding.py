"""ZeRO stages 1 and 2 as a rewrite of the data-parallel Program: each rank updates only the parameters it owns.

Stage 1: gradients are still averaged in full (the allreduce passes); the update ops of parameters
another rank owns are dropped, so their optimizer state is never created on this rank; after the
updates, the parameters are all-gathered from their owners in buckets of `segment_broadcast_MB`
(one `fleetc.c_sharding_allgather` per bucket), so every rank ends the step with every parameter whole.
Stage 2: also each gradient bucket's allreduce becomes a reduce-scatter into a padded buffer that lives
only inside the collective; a rank keeps its shard, and its own gradients are views of it
(`fleetc.shard_views`); gradients it does not own are never materialised in full after their bucket. The
buffer is flat, split evenly across the ranks, so a parameter may be updated in pieces (flat_sharding.py),
unless an update or a gradient reader needs whole gradients: then it is owner-major over whole parameters.
Under AMP each rank unscales and checks only the gradients it keeps, and `found_inf` is max-allreduced.
Stage 3: also the parameters, gathered where they are used (passes/sharding/param_sharding.py); no gather
after the update. By default each parameter bucket is split evenly and a rank keeps a flat piece of it
(flat_params.py), where stage 2's flat buckets apply; otherwise it owns whole parameters.
Under a pipeline the pass leaves the whole Program alone and records the stage in
`metadata["sharding"]["per_stage"]`: the pipeline split then runs this rewrite on each stage's optimizer
Program, over that stage's sharding group (passes/pipeline_parallel/sharded_stages.py); stage 3 there keeps the
stage's parameters as flat pieces, gathered once per step (passes/pipeline_parallel/stage3.py).

The trainer stamps `metadata["sharding"]` (degree, this rank's index in its sharding group, the group
partitions; the pass adds the parameters it owns); runs only there. Ownership: passes/sharding/plan.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetc.comm.sharding_ops import owner_major_starts
from fleetc.errors import PassStrategyError, StrategyError
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Block, Op, OpRole, Program, Ref, Var, VarKind
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import eliminate_dead_ops
from fleetc.passes.data_parallel.bucketing import MB, plan_buckets
from fleetc.passes.data_parallel.common import (
    ALLOC,
    START,
    WAIT,
    common_module,
    var_numel,
)
from fleetc.passes.data_parallel.merged import merged_values, update_block
from fleetc.passes.pipeline_parallel.stages import pipelined
from fleetc.passes.sharding.clip_sharding import clip_kept_gradients
from fleetc.passes.sharding.flat_params import (
    flat_layout,
    flat_parameter_plan,
    flat_params_refusal,
    narrow_updates,
    parameter_buckets,
    partial_pieces,
    regroup_gradients,
)
from fleetc.passes.sharding.flat_sharding import (
    flat_gathers,
    flat_refusal,
    gradient_buckets,
    piece_updates,
    rank_pieces,
    update_gradients,
)
from fleetc.passes.sharding.merged_sharding import regroup_merged, scatter_merged
from fleetc.passes.sharding.param_sharding import (
    parameter_owners,
    shard_parameters,
    whole_parameter_plan,
)
from fleetc.passes.sharding.plan import FlatBucket, ShardedBucket, assign_owners
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA

GATHER = "fleetc.c_sharding_allgather"
RS_START = "fleetc.c_sharding_reduce_scatter_start"
RS_WAIT = "fleetc.c_sharding_reduce_scatter_wait"
SHARD_VIEWS = "fleetc.shard_views"
FOUND_INF_MAX = "fleetc.c_sharding_found_inf_max"
CHECK_FINITE = "fleetc.check_finite_and_unscale"
GROUP = "sharding"
DP_GROUP = "sharding_dp"


def update_ops(program: Program) -> dict[int, list[Op]]:
    """Block index → the per-parameter optimizer ops in it (those whose `param` attribute names a parameter)."""
    found: dict[int, list[Op]] = {}
    for block, op in program.walk_ops():
        if OpRole.OPTIMIZE in op.role and op.attrs.get("param"):
            found.setdefault(block.idx, []).append(op)
    return found


def _belongs_to(program: Program, op: Op, params: set[str]) -> bool:
    """Whether `op` updates one of `params` or their optimizer state (a traced update's ops, AMP's master rounding)."""
    if OpRole.OPTIMIZE not in op.role:
        return False
    if op.attrs.get("param") in params:
        return True
    bindings = program.metadata.get("state_bindings", {})
    return any(name in params or bindings.get(name, [None])[0] in params for name in op.defined)


def _record_param_dtypes(program: Program, meta: dict) -> None:
    """Stage 3: every parameter's dtype as the Programs declare it (use_pure_fp16: low precision), those this rank
    holds nothing of and drops from its Program included: the module holds them in it too (fleet/sharded_params.py)."""
    meta["param_dtypes"] = {v.name: v.dtype for v in program.persistables() if v.kind is VarKind.PARAM}


class Sharding:
    name = "sharding"
    enabled_by = "sharding"
    summary = ("ZeRO sharding: each rank updates the parameters it owns; stage 2 also reduce-scatters gradients; "
               "stage 3 also gathers parameters where they are used")
    reads = ("sharding_configs.stage", "sharding_configs.sharding_degree", "sharding_configs.segment_broadcast_MB",
             "hybrid_configs.sharding_degree")

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        meta = program.metadata.get("sharding")
        if not meta:
            report.skipped_reason = "single process: no ranks to shard across"
            return program, report
        if meta["degree"] == 1:
            report.skipped_reason = "the sharding degree is 1: every rank keeps the whole state"
            return program, report
        updates = update_ops(program)
        degree, rank = meta["degree"], meta["rank"]
        stage = config.sharding_configs.stage
        if not meta.get("per_stage") and pipelined(program, config):
            return self._defer_to_pipeline_stages(program, meta, config, report)
        if stage == 3 and meta.get("per_stage"):  # a pipeline stage's optimizer Program
            return self._pipeline_stage_3(program, meta, updates, report)
        if stage == 3:
            program.metadata.setdefault("collective_groups", {}).update(meta["groups"])
            _record_param_dtypes(program, meta)
            refusal = self._flat_stage_3_refusal(program, meta, updates)
            if refusal is None:
                return self._flat_stage_3(program, meta, config, updates, report)
            report.notes.append(f"stage 3 owns whole parameters here, not even flat-bucket pieces: {refusal}")
            # every parameter has an owner, updated or not (a forward-only Program shards them too)
            owners = parameter_owners(program, degree)
            meta["param_owners"], meta["param_layout"] = owners, "whole"
        if not updates:
            if stage == 3:
                self._shard_whole_parameters(program, owners, degree, rank, config, report)
                report.changed = True
                return program, report
            report.skipped_reason = "the Program has no optimizer updates to shard"
            return program, report
        params = list(dict.fromkeys(op.attrs["param"] for ops in updates.values() for op in ops))
        sizes = {p: var_numel(program.var(p)) for p in params}
        buckets = gradient_buckets(program) if stage == 2 else []
        if stage != 2:
            refusal = "stage 1 or 3"
        else:
            refusal = flat_refusal(program, updates, buckets, params)
        if refusal is None:
            flat = [FlatBucket.of(bucket, sizes, degree) for bucket in buckets]
            pieces = rank_pieces(flat, rank)
            foreign = {p for p in params if p not in pieces}
            dp_group = DP_GROUP if meta.get("dp_degree", 1) > 1 else ""
            gradients = update_gradients(program, params)
            if merged_values(program):
                gradients.update(scatter_merged(program, flat, rank, degree, GROUP, dp_group, report))
            for block_idx in updates:
                self._shard_updates(program, program.blocks[block_idx], foreign, set(params),
                                    lambda _: flat_gathers(program, flat, report), report)
            piece_updates(program, updates, pieces, gradients, report)
            if merged_values(program):
                self._merged_over_ranks(program, gradients, foreign, dp_group, report)
            else:
                layouts = {bucket.names: (bucket.starts, bucket.segment, bucket.padding(degree),
                                          [name for name, _, _ in bucket.pieces(rank)]) for bucket in flat}
                self._reduce_scatter(program, lambda names: layouts[tuple(names)], foreign, meta, report)
            owned = sum(hi - lo for lo, hi in pieces.values())
            report.notes.append(f"stage 2, {degree} ranks, flat buckets split evenly: this rank (index {rank} in its "
                                f"sharding group) updates {owned} of {sum(sizes.values())} elements, pieces of "
                                f"{len(pieces)} of {len(params)} parameters")
            segment_mb = config.sharding_configs.segment_broadcast_MB
            if segment_mb != DISTRIBUTED_SCHEMA.defaults["sharding_configs.segment_broadcast_MB"]:
                report.notes.append(f"sharding_configs.segment_broadcast_MB={segment_mb} not applied: stage 2 on flat "
                                    "buckets gathers each gradient bucket through its reduce-scatter's layout (the "
                                    "pieces it updated), so the gradient buckets (fuse_grad_size_in_MB) size the "
                                    "gathers")
        else:
            if stage == 2:
                report.notes.append(f"stage 2 owns whole parameters here, not even flat-bucket pieces: {refusal}")
            if stage < 3:
                owners = assign_owners(sizes, degree, buckets or None)
            foreign = {p for p in params if owners[p] != rank}
            report.notes.append(f"stage {stage}, {degree} ranks: this rank (index {rank} in its sharding group) owns "
                                f"{len(params) - len(foreign)} of {len(params)} parameters "
                                f"({sum(sizes[p] for p in params if p not in foreign)} of {sum(sizes.values())} "
                                "elements)")
            gathers = (lambda updated: self._gathers(program, updated, owners, sizes, degree, config, report)) \
                if stage < 3 else None
            for block_idx in updates:
                self._shard_updates(program, program.blocks[block_idx], foreign, set(owners), gathers, report)
            if stage >= 2:
                self._reduce_scatter(program, lambda names: self._owner_major(names, owners, sizes, degree, rank),
                                     foreign, meta, report)
        if stage == 3:
            self._shard_whole_parameters(program, owners, degree, rank, config, report)
        program.metadata.setdefault("collective_groups", {}).update(meta["groups"])
        meta["owned"] = [p for p in params if p not in foreign]
        report.stats["owned_params"] = len(meta["owned"])
        report.changed = True
        return program, report

    @staticmethod
    def _flat_stage_3_refusal(program: Program, meta: dict, updates: dict[int, list[Op]]) -> str | None:
        """Why stage 3 cannot hold flat pieces of the parameter buckets here (None: it can). A Program compiled after
        the training step follows that step's layout (the trainer stamps it); a forward-only Program before any
        training step holds whole parameters (the module still holds them whole)."""
        if meta.get("param_layout"):
            return None if meta["param_layout"] == "flat" else "the training step holds whole parameters"
        if not updates:
            return "no training step compiled yet: the module still holds every parameter whole"
        return flat_params_refusal(program, updates)

    def _flat_stage_3(self, program: Program, meta: dict, config: Any, updates: dict[int, list[Op]],
                      report: PassReport) -> tuple[Program, PassReport]:
        """Stage 3 on flat parameter buckets (passes/sharding/flat_params.py): this rank keeps its piece of each
        bucket, the update of that piece and its gradient; each phase gathers the buckets before their uses."""
        degree, rank = meta["degree"], meta["rank"]
        updated = {op.attrs["param"] for ops in updates.values() for op in ops}
        buckets = parameter_buckets(program, degree, config.sharding_configs.segment_broadcast_MB, updated,
                                    meta.get("param_buckets"))
        pieces, partial = rank_pieces(buckets, rank), partial_pieces(buckets, rank)
        params = [name for bucket in buckets for name in bucket.names]
        dropped = set(params) - pieces.keys()
        if updates:
            for block_idx in updates:
                self._shard_updates(program, program.blocks[block_idx], dropped & updated, updated, None, report)
            gradients = update_gradients(program, list(updated))
            if merged_values(program):  # the update block reduce-scatters the accumulators by parameter bucket
                regroup_merged(program, buckets)
                dp_group = DP_GROUP if meta.get("dp_degree", 1) > 1 else ""
                gradients.update(scatter_merged(program, buckets, rank, degree, GROUP, dp_group, report))
                narrow_updates(program, updates, partial, gradients, report)
                self._merged_over_ranks(program, gradients, dropped & updated, dp_group, report)
            else:
                layouts = regroup_gradients(program, buckets, updated, report)
                narrow_updates(program, updates, partial, gradients, report)
                self._reduce_scatter(program, lambda names: flat_layout(layouts[tuple(names)], names, rank, degree),
                                     dropped, meta, report)
        shard_parameters(program, set(params), flat_parameter_plan(buckets, rank, degree), dropped, report)
        for name, (lo, hi) in partial.items():  # this rank's Var of a parameter it holds part of: the flat piece
            program.var(name).shape = (hi - lo,)
        held = sum(hi - lo for lo, hi in pieces.values())
        meta.update(param_layout="flat", param_buckets=[list(bucket.names) for bucket in buckets],
                    param_pieces={name: list(piece) for name, piece in pieces.items()},
                    owned=[p for p in params if p in pieces and p in updated])
        report.notes.append(f"stage 3, {degree} ranks, flat parameter buckets split evenly: this rank (index {rank} in "
                            f"its sharding group) holds {held} of {sum(sum(b.numels) for b in buckets)} elements, "
                            f"pieces of {len(pieces)} of {len(params)} parameters, in {len(buckets)} buckets")
        report.stats["owned_params"] = len(meta["owned"])
        report.changed = True
        return program, report

    def _merged_over_ranks(self, program: Program, gradients: dict[str, str], foreign: set[str], dp_group: str,
                           report: PassReport) -> None:
        """Gradient merge on flat buckets: AMP's check and clipping in the update block read this rank's pieces of
        the merged gradients (not those of `foreign` parameters), found_inf and the squared norm summed over ranks."""
        self._check_finite_over_ranks(program, update_block(program), {gradients[p] for p in foreign}, dp_group,
                                      report)
        clip_kept_gradients(program, GROUP, report, frozenset(gradients[p] for p in foreign))

    @staticmethod
    def _shard_whole_parameters(program: Program, owners: dict[str, int], degree: int, rank: int, config: Any,
                                report: PassReport) -> None:
        shard_parameters(program, set(owners), whole_parameter_plan(program, owners, degree, rank, config),
                         {p for p, owner in owners.items() if owner != rank}, report)

    def _defer_to_pipeline_stages(self, program: Program, meta: dict, config: Any,
                                  report: PassReport) -> tuple[Program, PassReport]:
        """Sharding × pipeline: leave the whole Program to the split, which shards each stage's optimizer Program."""
        stage = config.sharding_configs.stage
        meta["per_stage"] = {"stage": stage, "segment_broadcast_MB": config.sharding_configs.segment_broadcast_MB}
        if stage == 3:
            _record_param_dtypes(program, meta)
        report.notes.append(f"pipeline: stage {stage} over {meta['degree']} ranks runs on each pipeline stage's "
                            "optimizer Program, over that stage's sharding group (see pipeline_split)"
                            + ("; each stage's parameters are held as flat pieces between steps and gathered once "
                               "per step, before the stage's first micro-batch forward, by its gather Program"
                               if stage == 3 else ""))
        report.changed = True
        return program, report

    def _pipeline_stage_3(self, program: Program, meta: dict, updates: dict[int, list[Op]],
                          report: PassReport) -> tuple[Program, PassReport]:
        """Stage 3 on a pipeline stage's optimizer Program: stage 2's flat buckets (the stage's averaging bucket
        split evenly), but no gather after the update: this rank's Var of each parameter is its piece (or nothing),
        which it keeps between steps; the stage's gather Program (sharded_stages.py) makes them whole each step."""
        degree, rank = meta["degree"], meta["rank"]
        params = list(dict.fromkeys(op.attrs["param"] for ops in updates.values() for op in ops))
        sizes = {p: var_numel(program.var(p)) for p in params}
        buckets = gradient_buckets(program)
        refusal = flat_refusal(program, updates, buckets, params)
        if refusal is not None:
            raise PassStrategyError(f"sharding_configs.stage 3 with pipeline: {refusal}; a pipeline stage's "
                                    "parameters are held as flat pieces only; use sharding_configs.stage 2")
        flat = [FlatBucket.of(bucket, sizes, degree) for bucket in buckets]
        pieces, partial = rank_pieces(flat, rank), partial_pieces(flat, rank)
        dropped = set(params) - pieces.keys()
        for block_idx in updates:
            self._shard_updates(program, program.blocks[block_idx], dropped, set(params), None, report)
        narrow_updates(program, updates, partial, update_gradients(program, params), report)
        layouts = {bucket.names: bucket for bucket in flat}
        self._reduce_scatter(program, lambda names: flat_layout(layouts[tuple(names)], names, rank, degree),
                             dropped, meta, report)
        for name, (lo, hi) in partial.items():  # this rank's Var of a parameter it holds part of: the flat piece
            program.var(name).shape = (hi - lo,)
        for _, op in program.walk_ops():
            if dropped.intersection(op.inputs):
                raise StrategyError(f"sharding_configs.stage 3 with pipeline: op {op.name!r} ({op.type}) reads "
                                    f"parameter {min(dropped.intersection(op.inputs))!r}, which this rank does not "
                                    "hold; use sharding_configs.stage 2")
        for name in dropped:
            program.global_block.vars.pop(name, None)
        held = sum(hi - lo for lo, hi in pieces.values())
        meta.update(param_layout="flat", param_buckets=[list(bucket.names) for bucket in flat],
                    param_pieces={name: list(piece) for name, piece in pieces.items()},
                    owned=[p for p in params if p in pieces])
        program.metadata.setdefault("collective_groups", {}).update(meta["groups"])
        report.notes.append(f"stage 3 of a pipeline stage, {degree} ranks, its flat buckets split evenly: this rank "
                            f"(index {rank} in its sharding group) holds {held} of {sum(sizes.values())} elements, "
                            f"pieces of {len(pieces)} of {len(params)} parameters, between steps")
        report.stats["owned_params"] = len(meta["owned"])
        report.changed = True
        return program, report

    @staticmethod
    def _owner_major(names: list[str], owners: dict[str, int], sizes: dict[str, int], degree: int,
                     rank: int) -> tuple[list[int], int, int, list[str]]:
        """(starts, segment, padding, this rank's parameters) of a bucket of whole-owned parameters."""
        bucket = ShardedBucket.of(names, owners, sizes, degree)
        starts = owner_major_starts([sizes[n] for n in names], list(bucket.owners), bucket.segment)
        return starts, bucket.segment, bucket.padding(degree), bucket.owned_by(rank)

    def _shard_updates(self, program: Program, block: Block, foreign: set[str], everyone: set[str],
                       gathers: Callable[[list[str]], list[Op]] | None, report: PassReport) -> None:
        """Drop the updates of parameters other ranks own; all-gather every parameter after the block's last update
        (`gathers`, given the updated parameters: stages 1 and 2; under stage 3 parameters stay sharded)."""
        last = max(i for i, op in enumerate(block.ops) if _belongs_to(program, op, everyone))
        updated = list(dict.fromkeys(op.attrs["param"] for op in block.ops if op.attrs.get("param") in everyone
                                     and OpRole.OPTIMIZE in op.role))
        ops: list[Op] = []
        for index, op in enumerate(block.ops):
            if _belongs_to(program, op, foreign):
                report.count("updates_dropped")
            else:
                ops.append(op)
            if index == last and gathers is not None:
                ops.extend(gathers(updated))
        block.ops = ops
        used = {name for _, op in program.walk_ops() for name in block_reads(program, op)} | {
            name for _, op in program.walk_ops() for name in op.defined}
        for name, var in list(program.global_block.vars.items()):
            if var.kind is VarKind.OPTIMIZER_STATE and name not in used:
                del program.global_block.vars[name]
                program.metadata.get("state_bindings", {}).pop(name, None)
                report.count("state_vars_dropped")

    def _gathers(self, program: Program, updated: list[str], owners: dict[str, int], sizes: dict[str, int],
                 degree: int, config: Any, report: PassReport) -> list[Op]:
        cap = config.sharding_configs.segment_broadcast_MB * MB
        order = [(p, program.var(p).dtype, program.var(p).nbytes()) for p in updated]
        ops = []
        for bucket in plan_buckets(order, cap, cap, len(order)):
            sharded = ShardedBucket.of(bucket.grads, owners, sizes, degree)
            label = program.unique_name(f"shard_gather{report.stats.get('gather_buckets', 0)}")
            starts = owner_major_starts([sizes[p] for p in sharded.names], list(sharded.owners), sharded.segment)
            ops.append(Op(label, GATHER, ([Ref(p) for p in sharded.names], starts, sharded.segment, GROUP, label), {},
                          list(sharded.names),
                          {"op_role": int(OpRole.COLLECTIVE), "provenance": self.name,
                           "module_path": common_module(program, [p + "@GRAD" for p in sharded.names])}))
            report.count("gather_buckets")
            report.count("padding_elements", sharded.padding(degree))
        return ops

    def _reduce_scatter(self, program: Program, layout: Callable[[list[str]], tuple[list[int], int, int, list[str]]],
                        foreign_params: set[str], meta: dict, report: PassReport) -> None:
        """Each gradient bucket's allreduce becomes a reduce-scatter; this rank's gradients (or their pieces: the
        Vars' shapes say) are views of its shard. `layout(bucket's parameters)`: (each one's start in the padded
        buffer, the segment, the padding, the parameters this rank has a part of, in order)."""
        if merged_values(program):
            report.notes.append("stage 2 under gradient merge: the accumulators stay whole and are allreduced once "
                                "per k steps (as stage 1); only the optimizer state is sharded")
            return
        block = program.global_block
        waits = {op.args[1].name: op for op in block.ops if op.type == WAIT}
        starts = {op.name: op for op in block.ops if op.type == START}
        replaced: dict[str, list[Op]] = {}
        for start in starts.values():
            wait = waits[start.outputs[0]]
            grads = list(wait.outputs)
            starts_, segment, padding, owned = layout([g.removesuffix("@GRAD") for g in grads])
            label = start.args[5]
            work = block.add_var(Var(program.unique_name(f"{label}@SHARD_WORK"), None, "work", block.vars[grads[0]].device))
            shard = block.add_var(Var(program.unique_name(f"{label}@SHARD"), (segment,), block.vars[grads[0]].dtype,
                                      block.vars[grads[0]].device))
            attrs = {"op_role": int(OpRole.COLLECTIVE), "provenance": self.name, "module_path": common_module(program, grads)}
            new_start = Op(program.unique_name(f"{label}_reduce_scatter"), RS_START,
                           (list(start.args[1]), starts_, segment, GROUP,
                            DP_GROUP if meta.get("dp_degree", 1) > 1 else "", label), {}, [work.name], dict(attrs))
            new_wait = Op(program.unique_name(f"{label}_reduce_scatter_wait"), RS_WAIT, (Ref(work.name),), {},
                          [shard.name], dict(attrs))
            mine = [g + "@GRAD" for g in owned]
            views = [Op(program.unique_name(f"{label}_owned_grads"), SHARD_VIEWS,
                        (Ref(shard.name), [list(block.vars[g].shape) for g in mine]), {}, mine,
                        {"op_role": int(OpRole.BACKWARD), "provenance": self.name,
                         "module_path": attrs["module_path"]})] if mine else []
            replaced[start.name] = [new_start]
            replaced[wait.name] = [new_wait, *views]
            del block.vars[start.args[0].name], block.vars[start.outputs[0]]
            report.count("reduce_scatter_buckets")
            report.count("padding_elements", padding)
        allocs = {op.name for op in block.ops if op.type == ALLOC and op.outputs[0] not in block.vars}
        block.ops = [new for op in block.ops if op.name not in allocs for new in replaced.get(op.name, [op])]
        foreign = {f"{p}@GRAD" for p in foreign_params}
        self._check_finite_over_ranks(program, block, foreign, DP_GROUP if meta.get("dp_degree", 1) > 1 else "",
                                      report)
        clip_kept_gradients(program, GROUP, report)
        eliminate_dead_ops(program, block, set(program.fetches.values()))  # e.g. a transpose of a gradient nobody reads
        kept = {name for op in block.ops for name in op.defined}
        for grad in [g for g in block.vars if g.endswith("@GRAD") and g not in kept
                     and program.find_var(g.removesuffix("@GRAD")) is not None]:
            readers = [op.name for _, op in program.walk_ops() if grad in block_reads(program, op)]
            if readers:
                raise StrategyError(f"sharding_configs.stage 2: op {readers[0]!r} reads gradient {grad!r}, which this "
                                    "rank does not keep (another rank owns it); use stage 1 with this Program")
            del block.vars[grad]

    def _check_finite_over_ranks(self, program: Program, block: Block, foreign: set[str], dp_group: str,
                                 report: PassReport) -> None:
        """AMP: each rank unscales and checks only the gradients it keeps (not those computed from `foreign` ones,
        such as their fp32 casts); found_inf is then max-allreduced so every rank skips the same steps (and issues
        the same collectives inside the update block)."""
        derived = set(foreign)
        for index, op in enumerate(list(block.ops)):
            if op.type != CHECK_FINITE:
                # a collective reading them (gradient merge's reduce-scatter of whole accumulators) gives this rank
                # its own pieces, not values of theirs
                if derived.intersection(op.inputs) and OpRole.COLLECTIVE not in op.role:
                    derived.update(op.defined)
                continue
            pairs = [(ref, out) for ref, out in zip(op.args[0], op.outputs[:-1]) if ref.name not in derived]
            for dropped in set(op.outputs[:-1]) - {out for _, out in pairs}:
                del block.vars[dropped]
            found_inf = op.outputs[-1]
            op.args = ([ref for ref, _ in pairs], *op.args[1:])
            op.outputs = [*(out for _, out in pairs), found_inf]
            everywhere = block.add_var(Var(program.unique_name(f"{found_inf}@ALL_RANKS"), block.vars[found_inf].shape,
                                           block.vars[found_inf].dtype, block.vars[found_inf].device))
            for later in block.ops[index + 1:]:
                later.rename_inputs({found_inf: everywhere.name})
            block.ops.insert(index + 1, Op(program.unique_name("found_inf_max"), FOUND_INF_MAX,
                                           (Ref(found_inf), GROUP, dp_group), {}, [everywhere.name],
                                           {"op_role": int(OpRole.COLLECTIVE), "provenance": self.name}))
            report.count("found_inf_allreduces")
