"""The pass order: the passes a strategy asks for, built in one readable place, in a fixed documented order.

Order (DESIGN.md): gradient clipping and LARS/LAMB (they define the optimize section) → AMP → recompute
→ fusion → CPU convolution layout → gradient merge → local SGD / allreduce → sharding → pipeline split → optimizer fusion → DCE
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
from fleetc.passes.layout import ChannelsLast
from fleetc.passes.memory import InplacePointwise, ReuseBuffers
from fleetc.passes.optimizers import AdaptiveLocalSGD, GradClip, GradientClip, Lamb, Lars, LocalSGD
from fleetc.passes.parameter_server import ParameterServerRewrite
from fleetc.passes.pipeline_parallel.split import PipelineSplit
from fleetc.passes.precision import AutoMixedPrecision
from fleetc.passes.recompute import Recompute, RecomputePolicy
from fleetc.passes.sharding import Sharding
from fleetc.strategy.distributed import DISTRIBUTED_SCHEMA
from fleetc.strategy.fields import PADDLE_ONLY_PATHS

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
    ChannelsLast,  # CPU convolutions on channels_last activations (after fusion: it marks the fused batch norms)
    GradientMerge,  # update once per k steps, on summed gradients
    LocalSGD,  # data parallel: no gradient allreduce, parameters averaged every k steps instead
    AdaptiveLocalSGD,  # the same with k adapted from the loss
    ParameterServerRewrite,  # parameter-server workers: pulls, and the update moved to the servers behind a push
    InsertAllreduce,  # data parallel only: average every gradient across ranks
    FuseAllreduce,  # one flat buffer and one collective per bucket of gradients
    Sharding,  # owners update their parameters; stage 2 turns the buckets into reduce-scatters (before views)
    # (under a pipeline it defers: PipelineSplit shards each stage's optimizer Program over the stage's group)
    AllreduceViews,  # gradient producers write into their bucket's buffer (no packing copy)
    OverlapAllreduce,  # wait for a bucket just before its first consumer (sync_nccl_allreduce=False)
    PipelineSplit,  # stages from device_guard (or an automatic cut), per-stage Programs and the schedule
    FuseOptimizerOps,  # one multi-tensor update per group
    DeadCodeElimination,  # results nobody reads (e.g. saved stats of unused outputs)
    InplacePointwise,  # memory planning, last: liveness of the final Program decides what may be overwritten
    ReuseBuffers,  # then results written into temporaries that just died (the in-place rewrites already taken)
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
    ("build_strategy.fuse_relu_depthwise_conv", "a relu+depthwise-conv fusion pass"),
    ("build_strategy.fuse_broadcast_ops", "a broadcast fusion pass (data parallel only)"),
)


def _lookup(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# Execution settings that do not apply to fleetc's modes: (dotted field, default, why). The others are the runtime's
# (fleetc/runtime/execution.py, listed under the report's `execution:`).
_EXECUTION = (
    ("execution_strategy.use_thread_barrier", False,
     "not applicable: a parameter-server setting (Paddle's a_sync mode); outside PS mode the scheduler joins its "
     "threads at the end of every step anyway"),
)


# Settings with nothing to act on in fleetc's compiled step: (dotted field, default, why nothing changes).
_NOTHING_TO_ACT_ON = (
    ("recompute_configs.checkpoint_shape", (), "it describes checkpoints offloaded to host memory, and "
     "offloading is not implemented"),
    ("find_unused_parameters", False, "the captured step knows which parameters get no gradient, so nothing has "
     "to look for them at run time (their allreduce is left out)"),
    ("cudnn_exhaustive_search", False, "fleetc does not choose cuDNN algorithms; torch.backends.cudnn.benchmark "
     "is left as you set it"),
    ("conv_workspace_size_limit", 512, "fleetc does not size cuDNN workspaces; PyTorch chooses them"),
    ("cudnn_batchnorm_spatial_persistent", False, "fleetc does not pick cuDNN batch-norm modes; PyTorch does"),
    ("build_strategy.enable_backward_optimizer_op_deps", True, "ops run in Program order, where every optimizer op "
     "already follows the backward ops it reads"),
    ("build_strategy.cache_runtime_context", False, "the generated step has no per-op runtime context to cache"),
)


def _unused_settings(config: Any, switch: str) -> str:
    """For a switch that is not applied: its `<switch>_configs` values that differ from the defaults, in words."""
    section = f"{switch}_configs"
    changed = [f"{path.removeprefix(section + '.')}={config.get(path)!r}" for path, default in
               DISTRIBUTED_SCHEMA.defaults.items() if path.startswith(section + ".") and config.get(path) != default]
    return f"; so {section} ({', '.join(changed)}) is not used either" if changed else ""


def strategy_requests_without_pass(config: Any) -> dict[str, str]:
    """Fields set in `config` that this version does not act on → why nothing changed."""
    notes = {field: f"not applied: {what} is not implemented in this version of fleetc{_unused_settings(config, field)}"
             for field, what in _PENDING if _lookup(config, field) is True}
    notes.update({field: why for field, default, why in _EXECUTION if _lookup(config, field) != default})
    notes.update({field: f"not applied: {why}" for field, default, why in _NOTHING_TO_ACT_ON
                  if _lookup(config, field) != default})
    notes.update({path: f"not applied: a Paddle setting fleetc accepts but does not implement "
                        f"({DISTRIBUTED_SCHEMA.fields[path].doc.removeprefix('Paddle: ')})"
                  for path in sorted(PADDLE_ONLY_PATHS) if config.get(path) != DISTRIBUTED_SCHEMA.defaults[path]})
    return notes
