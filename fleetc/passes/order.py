"""The pass order: the passes a strategy asks for, built in one readable place, in a fixed documented order.

Order (DESIGN.md): gradient clipping and LARS/LAMB (they define the optimize section) → AMP → recompute
→ fusion → gradient merge → local SGD / allreduce → sharding → pipeline split → optimizer fusion → DCE
→ memory planning. Passes not built yet are listed in `strategy_requests_without_pass`, so a flag that
is on never goes silently unheeded.
"""
from __future__ import annotations

from typing import Any

from fleetc.passes.base import Pass
from fleetc.passes.cleanup import DeadCodeElimination, RemoveNoopViews
from fleetc.passes.data_parallel import (
    AllreduceViews,
    FuseAllreduce,
    InsertAllreduce,
    OverlapAllreduce,
    SyncBatchNorm,
)
from fleetc.passes.fusion import (
    AutoFusion,
    FuseBnAct,
    FuseBnAddAct,
    FuseDropoutAdd,
    FuseElementwiseAddAct,
    FuseGemmEpilogue,
    FuseOptimizerOps,
)
from fleetc.passes.gradient_merge import GradientMerge
from fleetc.passes.optimizers import AdaptiveLocalSGD, GradClip, GradientClip, Lamb, Lars, LocalSGD
from fleetc.passes.pipeline_parallel.split import PipelineSplit
from fleetc.passes.precision import AutoMixedPrecision
from fleetc.passes.recompute import Recompute, RecomputePolicy

# The pass order, one line of why per pass. A pass with `enabled_by` runs when that strategy field is True; the
# others are always in the order and decide for themselves (the data-parallel passes do nothing in one process).
# The named fusions run larger, more specific patterns first, so where matches overlap (bn+add+relu vs add+relu)
# the outcome is fixed by this order.
PASS_ORDER: tuple[type, ...] = (
    RemoveNoopViews,  # detach/clone/same-shape views from capture hide fusion patterns and cost calls
    # fleetc.compile(grad_clip=...): part of the optimize section from here on, so AMP, gradient merge and data
    # parallel place it as Paddle does
    GradientClip,
    Lars,  # Momentum → LARS momentum; before AMP, whose master weights the new update then reads
    Lamb,  # Adam → LAMB
    AutoMixedPrecision,  # casts first: later passes see the final dtypes
    SyncBatchNorm,  # data parallel only: batch-norm statistics over all ranks' samples (before bn fusion)
    Recompute,  # before fusion: replayed ops get fused too
    FuseBnAddAct,  # bn + residual add + act (ResNet block tail)
    FuseBnAct,  # bn + act
    FuseGemmEpilogue,  # addmm [+ view] [+ act]; backward dX, dW, dBias in one op
    FuseDropoutAdd,  # dropout + residual add
    FuseElementwiseAddAct,  # whatever add + act remains
    AutoFusion,  # after the named fusion passes: fuses the pointwise chains they leave
    GradientMerge,  # update once per k steps, on summed gradients
    LocalSGD,  # data parallel: no gradient allreduce, parameters averaged every k steps instead
    AdaptiveLocalSGD,  # the same with k adapted from the loss
    InsertAllreduce,  # data parallel only: average every gradient across ranks
    FuseAllreduce,  # one flat buffer and one collective per bucket of gradients
    AllreduceViews,  # gradient producers write into their bucket's buffer (no packing copy)
    OverlapAllreduce,  # wait for a bucket just before its first consumer (sync_nccl_allreduce=False)
    # (sharding goes here)
    PipelineSplit,  # stages from device_guard (or an automatic cut), per-stage Programs and the schedule
    FuseOptimizerOps,  # one multi-tensor update per group
    DeadCodeElimination,  # results nobody reads (e.g. saved stats of unused outputs)
)


# Passes with `enabled_by = None` that an argument of fleetc.compile switches on, rather than running always.
SWITCHED_BY_ARGUMENT = {GradientClip: "grad_clip"}


def ordered_passes(config: Any, recompute_policy: RecomputePolicy | None = None,
                   grad_clip: GradClip | None = None) -> list[Pass]:
    """The passes to run for a strategy config (and `fleetc.compile`'s grad_clip), in order."""
    made = {Recompute: lambda: Recompute(recompute_policy), GradientClip: lambda: GradientClip(grad_clip)}
    arguments = {"grad_clip": grad_clip}
    return [made.get(p, p)() for p in PASS_ORDER
            if (arguments[SWITCHED_BY_ARGUMENT[p]] is not None if p in SWITCHED_BY_ARGUMENT
                else p.enabled_by is None or _lookup(config, p.enabled_by) is True)]


def fusion_flags() -> list[str]:
    """The build_strategy fields that switch the named fusion passes on, in pass order."""
    return [p.enabled_by.removeprefix("build_strategy.") for p in PASS_ORDER
            if (p.enabled_by or "").startswith("build_strategy.fuse_")]


def all_pass_names() -> list[str]:
    """Every pass name the pass order can contain (for --disable-pass validation)."""
    return [p.name for p in PASS_ORDER]


# Strategy switches whose rewrite is not built yet: (dotted field, what would implement it).
_PENDING = (
    ("recompute_configs.enable_offload", "offloading checkpoints to host memory (recompute keeps them on the device)"),
    ("sharding", "the sharding pass"),
    ("build_strategy.fuse_relu_depthwise_conv", "a relu+depthwise-conv fusion pass"),
    ("build_strategy.fuse_broadcast_ops", "a broadcast fusion pass (data parallel only)"),
    ("build_strategy.enable_inplace", "in-place memory reuse"),
    ("build_strategy.enable_sequential_execution", "the multi-threaded scheduler (execution is already sequential)"),
)


def _lookup(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# Execution settings the sequential runtime cannot honour yet: (dotted field, default, what happens instead).
_EXECUTION = (
    ("execution_strategy.num_threads", 1, "ops run on one thread (the multi-threaded scheduler is not built yet)"),
    ("execution_strategy.num_iteration_per_run", 1, "each step() runs exactly one iteration"),
    ("execution_strategy.num_iteration_per_drop_scope", 10,
     "temporaries are freed right after their last use in every iteration, so there is no scope to drop"),
    ("execution_strategy.use_thread_barrier", False, "ops run on one thread, so there is nothing to synchronise"),
)


def strategy_requests_without_pass(config: Any) -> dict[str, str]:
    """Fields set in `config` that this version does not act on → why nothing changed."""
    notes = {field: f"not applied: {what} is not implemented in this version of fleetc"
             for field, what in _PENDING if _lookup(config, field) is True}
    notes.update({field: f"not applied: {why}" for field, default, why in _EXECUTION
                  if _lookup(config, field) != default})
    return notes
