"""The pass pipeline, built from the strategy in one readable place, in a fixed documented order.

Order (DESIGN.md): AMP → recompute → fusion → gradient merge → allreduce → sharding → pipeline split
→ optimizer fusion → DCE → memory planning. Passes not built yet are listed in
`strategy_requests_without_pass`, so a flag that is on never goes silently unheeded.
"""
from __future__ import annotations

from typing import Any

from fleetc.passes.allreduce import InsertAllreduce
from fleetc.passes.allreduce_fusion import FuseAllreduce
from fleetc.passes.allreduce_overlap import OverlapAllreduce
from fleetc.passes.amp import AutoMixedPrecision
from fleetc.passes.auto_fusion import AutoFusion
from fleetc.passes.base import Pass
from fleetc.passes.dce import DeadCodeElimination
from fleetc.passes.gradient_merge import GradientMerge
from fleetc.passes.noop_views import RemoveNoopViews
from fleetc.passes.recompute import Recompute, RecomputePolicy
from fleetc.passes.sync_batch_norm import SyncBatchNorm


def build_pipeline(config: Any, recompute_policy: RecomputePolicy | None = None) -> list[Pass]:
    """The passes to run for a strategy config, in order."""
    return [
        RemoveNoopViews(),  # detach/clone/same-shape views from capture hide fusion patterns and cost calls
        *([AutoMixedPrecision()] if config.amp else []),  # casts first: later passes see the final dtypes
        *([Recompute(recompute_policy)] if config.recompute else []),  # after view cleanup: fewer ops to re-run
        # after the named fusion passes: fuses the pointwise chains they leave
        *([AutoFusion()] if config.build_strategy.enable_auto_fusion else []),
        *([GradientMerge()] if config.gradient_merge else []),  # update once per k steps, on summed gradients
        SyncBatchNorm(),  # data parallel only: batch-norm statistics over all ranks' samples
        InsertAllreduce(),  # data parallel only: average every gradient across ranks
        FuseAllreduce(),  # one flat buffer and one collective per bucket of gradients
        OverlapAllreduce(),  # wait for a bucket just before its first consumer (sync_nccl_allreduce=False)
        DeadCodeElimination(),  # results nobody reads (e.g. saved stats of unused outputs)
    ]


def all_pass_names() -> list[str]:
    """Every pass name the pipeline can contain (for --disable-pass validation)."""
    return [RemoveNoopViews.name, AutoMixedPrecision.name, Recompute.name, AutoFusion.name, GradientMerge.name,
            SyncBatchNorm.name, InsertAllreduce.name, FuseAllreduce.name, OverlapAllreduce.name,
            DeadCodeElimination.name]


# Strategy switches whose rewrite is not built yet: (dotted field, what would implement it).
_PENDING = (
    ("amp_configs.use_pure_fp16", "low-precision parameters with float32 master copies (amp keeps float32 "
                                  "parameters and casts them per use)"),
    ("pipeline", "pipeline partitioning"),
    ("sharding", "the sharding pass"),
    ("lars", "the LARS optimizer lowering"),
    ("lamb", "the LAMB optimizer lowering"),
    ("localsgd", "LocalSGD"),
    ("adaptive_localsgd", "adaptive LocalSGD"),
    ("build_strategy.fuse_elewise_add_act_ops", "the elementwise add+activation fusion pass"),
    ("build_strategy.fuse_bn_act_ops", "the batch-norm+activation fusion pass"),
    ("build_strategy.fuse_bn_add_act_ops", "the batch-norm+add+activation fusion pass"),
    ("build_strategy.fuse_gemm_epilogue", "the gemm-epilogue fusion pass"),
    ("build_strategy.fuse_dropout_add", "the dropout+add fusion pass"),
    ("build_strategy.fuse_all_optimizer_ops", "the fused optimizer pass"),
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
