"""The strategy field table: every field's name, kind, default and meaning, in one place.

Classes, validation, prototxt, dict/JSON and display are all derived from these tables.
Defaults are those of Paddle's ``distributed_strategy.proto``; where Paddle's older
collective-training guide lists other values, the proto wins:

* ``fuse_grad_size_in_TFLOPS`` 50 (guide: 20), ``conv_workspace_size_limit`` 512 (guide: 4000),
  ``cudnn_exhaustive_search`` and ``cudnn_batchnorm_spatial_persistent`` False (guide: True),
  ``execution_strategy.num_iteration_per_run`` 1 (guide: 3).

fleetc extensions over Paddle: ``recompute_configs.checkpoints`` may be ``"auto"``,
``recompute_configs.memory_budget_mb``, ``amp_configs.dtype`` and ``build_strategy.conv_channels_last``.
"""

from __future__ import annotations

from fleetc.strategy.field_types import (  # noqa: F401  (re-exported: the table's building blocks)
    BOOL,
    COUNT,
    NAMES,
    NON_NEGATIVE,
    POSITIVE,
    SIZE,
    Field,
    FieldOrSection,
    Section,
    flag,
)
from fleetc.strategy.kinds import (
    Bounds,
    Checkpoints,
    Choice,
    Float,
    Int,
    ListOf,
    Nullable,
)
from fleetc.strategy.paddle_only import (
    extended_section,
    paddle_only_paths,
    with_paddle_fields,
)

RECOMPUTE_CONFIGS = Section("recompute_configs", (
    Field("checkpoints", Checkpoints(), (),
          "where to cut the forward pass: var names or module paths, or 'auto' to let fleetc choose"),
    flag("enable_offload", "keep checkpoints in host memory between forward and backward"),
    Field("checkpoint_shape", ListOf(int), (), "shape of the checkpoints, needed when offloading"),
    Field("memory_budget_mb", Nullable(POSITIVE), None,
          "fleetc: the step's estimated peak (MiB) to fit when checkpoints is empty or 'auto'; None = no budget"),
), "recompute settings")

GRADIENT_MERGE_CONFIGS = Section("gradient_merge_configs", (
    Field("k_steps", COUNT, 1, "apply the optimizer once every k_steps steps"),
    flag("avg", "divide the merged gradients by k_steps (False: keep their sum)", True),
), "gradient merge settings")

PIPELINE_CONFIGS = Section("pipeline_configs", (
    Field("micro_batch_size", COUNT, 1, "samples per micro-batch", aliases=("micro_batch",)),
    Field("accumulate_steps", COUNT, 1, "micro-batches per mini-batch (gradients accumulate over them)"),
    Field("schedule_mode", Choice(("1F1B", "FThenB", "VPP", "ZBH1")), "1F1B",
          "micro-batch order: 1F1B, all forwards then all backwards (FThenB), interleaved 1F1B over vpp_degree "
          "chunks per stage (VPP), or zero-bubble ZB-H1 (backward split into input and weight gradients)"),
    Field("vpp_degree", COUNT, 1, "model chunks (virtual stages) per pipeline stage; more than 1 needs 'VPP'"),
), "pipeline parallel settings")

AMP_CONFIGS = Section("amp_configs", (
    Field("init_loss_scaling", POSITIVE, 32768.0, "loss scale at the first step"),
    Field("incr_every_n_steps", COUNT, 1000, "grow the scale after this many clean steps in a row"),
    Field("decr_every_n_nan_or_inf", COUNT, 2, "shrink the scale after this many overflowing steps"),
    Field("incr_ratio", Float(Bounds(gt=1)), 2.0, "factor the scale grows by"),
    Field("decr_ratio", Float(Bounds(gt=0, lt=1)), 0.8, "factor the scale shrinks by"),
    flag("use_dynamic_loss_scaling", "adapt the loss scale to overflows (False: keep it fixed)", True),
    Field("custom_white_list", NAMES, (), "op types to always run in low precision"),
    Field("custom_black_list", NAMES, (), "op types to always run in float32"),
    Field("custom_black_varnames", NAMES, (), "vars whose ops stay in float32"),
    flag("use_pure_fp16", "keep parameters in low precision too, with float32 master copies"),
    flag("use_fp16_guard", "with use_pure_fp16, cast only ops inside fp16_guard regions", True),
    Field("dtype", Nullable(Choice(("float16", "bfloat16"))), None,
          "fleetc: low-precision type; None = bfloat16 on CPU, float16 on CUDA"),
), "automatic mixed precision settings")

SHARDING_CONFIGS = Section("sharding_configs", (
    Field("stage", Int(choices=(1, 2, 3)), 1,
          "what is sharded: 1 optimizer states, 2 also gradients, 3 also parameters"),
    Field("sharding_degree", COUNT, 8, "number of ranks the state is split across"),
    Field("segment_broadcast_MB", POSITIVE, 32.0, "size of the parameter broadcast segments in MB"),
), "ZeRO-style sharding settings")

HYBRID_CONFIGS = Section("hybrid_configs", (
    Field("dp_degree", Int(Bounds(ge=-1)), -1, "data-parallel replicas; -1: whatever the world size leaves"),
    Field("mp_degree", COUNT, 1, "tensor (model) parallel degree; fleetc supports 1 (checked when compiling)"),
    Field("pp_degree", COUNT, 1, "pipeline stages (with pipeline on)"),
    Field("sharding_degree", COUNT, 1, "ranks the sharded state is split across (1: from sharding_configs)"),
), "hybrid parallel degrees: the process mesh that data parallel, pipeline and sharding share")

LARS_CONFIGS = Section("lars_configs", (
    Field("lars_coeff", POSITIVE, 0.001, "trust coefficient of the layer-wise learning rate"),
    Field("lars_weight_decay", NON_NEGATIVE, 0.0005, "weight decay inside the LARS update"),
    Field("epsilon", NON_NEGATIVE, 0.0, "added to the denominator for numerical stability"),
    Field("exclude_from_weight_decay", NAMES, (), "parameter name patterns that get no weight decay"),
), "LARS optimizer settings")

LAMB_CONFIGS = Section("lamb_configs", (
    Field("lamb_weight_decay", NON_NEGATIVE, 0.01, "weight decay inside the LAMB update"),
    Field("exclude_from_weight_decay", NAMES, (), "parameter name patterns that get no weight decay"),
), "LAMB optimizer settings")

LOCALSGD_CONFIGS = Section("localsgd_configs", (
    Field("k_steps", COUNT, 1, "average parameters across ranks every k_steps steps"),
    Field("begin_step", COUNT, 1, "step from which local SGD starts (before it: every step)"),
), "local SGD settings")

ADAPTIVE_LOCALSGD_CONFIGS = Section("adaptive_localsgd_configs", (
    Field("init_k_steps", COUNT, 1, "first averaging interval, later adapted from loss and lr"),
    Field("begin_step", COUNT, 1, "step from which adaptive local SGD starts"),
), "adaptive local SGD settings")

BUILD_STRATEGY = Section("build_strategy", (
    flag("enable_sequential_execution", "run ops strictly in program order"),
    flag("fuse_elewise_add_act_ops", "fuse an elementwise add with the activation after it"),
    flag("fuse_bn_act_ops", "fuse batch norm with the activation after it"),
    flag("fuse_bn_add_act_ops", "fuse batch norm, a residual add and an activation", True),
    flag("fuse_gemm_epilogue", "fuse a matmul with the bias add (and activation) after it"),
    flag("fuse_dropout_add", "fuse dropout with the residual add after it"),
    flag("fuse_relu_depthwise_conv", "fuse relu into the depthwise convolution after it"),
    flag("fuse_broadcast_ops", "fuse the parameter broadcasts"),
    flag("fuse_all_optimizer_ops", "update all parameters with one fused optimizer op per group"),
    flag("enable_inplace", "let ops write their output over an input that is no longer needed"),
    flag("memory_optimize", "let matmuls and sums write their result into a temporary that just died"),
    flag("enable_backward_optimizer_op_deps", "start optimizer ops only after all backward ops", True),
    flag("enable_auto_fusion", "fuse chains of elementwise ops automatically"),
    flag("cache_runtime_context", "reuse per-op runtime context between steps"),
    flag("conv_channels_last", "run CPU convolutions and the ops between them on channels_last activations"),
), "graph building (fusion and scheduling) switches", as_object=True)

A_SYNC_CONFIGS = Section("a_sync_configs", (
    Field("k_steps", Int(Bounds(ge=-1)), -1,
          "parameter-server updates with a_sync: 0 or -1 async, k > 0 geo (local steps between syncs)"),
), "parameter-server asynchronous update settings (docs/parameter_server.md)")

EXECUTION_STRATEGY = Section("execution_strategy", (
    Field("num_threads", COUNT, 1, "threads the scheduler runs ops on"),
    Field("num_iteration_per_drop_scope", COUNT, 10, "free cached temporaries every this many steps"),
    Field("num_iteration_per_run", COUNT, 1, "training iterations per call"),
    flag("use_thread_barrier", "synchronize the scheduler threads after each step"),
), "executor settings", as_object=True)

DISTRIBUTED: tuple[FieldOrSection, ...] = (
    flag("recompute", "recompute forward segments during backward to save activation memory"),
    RECOMPUTE_CONFIGS,
    flag("gradient_merge", "accumulate gradients over several steps before updating"),
    GRADIENT_MERGE_CONFIGS,
    flag("pipeline", "split the model into stages (by device_guard) and pipeline micro-batches"),
    PIPELINE_CONFIGS,
    flag("amp", "train with automatic mixed precision and dynamic loss scaling"),
    AMP_CONFIGS,
    flag("sharding", "shard optimizer state (and more, by stage) across data-parallel ranks"),
    SHARDING_CONFIGS,
    HYBRID_CONFIGS,
    flag("lars", "use the LARS optimizer update"),
    LARS_CONFIGS,
    flag("lamb", "use the LAMB optimizer update"),
    LAMB_CONFIGS,
    flag("localsgd", "update locally and average parameters every few steps"),
    LOCALSGD_CONFIGS,
    flag("adaptive_localsgd", "local SGD with an interval adapted during training"),
    ADAPTIVE_LOCALSGD_CONFIGS,
    flag("a_sync", "asynchronous updates; parameter-server mode only", True),
    A_SYNC_CONFIGS,
    flag("auto", "let the framework pick strategies automatically"),
    flag("sync_nccl_allreduce", "wait for each allreduce before its result is used", True),
    Field("nccl_comm_num", COUNT, 1, "communicators used round-robin for gradient allreduce"),
    flag("use_hierarchical_allreduce", "reduce inside each node, allreduce across nodes, broadcast back"),
    Field("hierarchical_allreduce_inter_nranks", COUNT, 1, "ranks per node for hierarchical allreduce"),
    flag("sync_batch_norm", "compute batch-norm statistics across all data-parallel ranks"),
    flag("fuse_all_reduce_ops", "bucket gradient allreduces", True),
    flag("fp16_allreduce", "average float32 gradients in low precision (fp16 on CUDA, bf16 on CPU), cast back after"),
    Field("fuse_grad_size_in_MB", COUNT, 32, "largest allreduce bucket, in MB"),
    Field("fuse_grad_size_in_TFLOPS", COUNT, 50, "most gradients in one allreduce bucket"),
    Field("last_comm_group_size_MB", POSITIVE, 1.0, "size of the last allreduce bucket, in MB"),
    flag("find_unused_parameters", "look for parameters that got no gradient this step"),
    flag("cudnn_exhaustive_search", "try every cuDNN convolution algorithm and keep the fastest"),
    Field("conv_workspace_size_limit", SIZE, 512, "workspace limit for cuDNN convolutions, in MB"),
    flag("cudnn_batchnorm_spatial_persistent", "use cuDNN's persistent spatial batch-norm mode"),
    BUILD_STRATEGY,
    EXECUTION_STRATEGY,
)

# Newer-style ``paddle.distributed.Strategy`` sections: (section, gated, keys), where each key maps
# to a DistributedStrategy path, or is a Field of its own. A gated section's keys apply only
# while its own ``enable`` is True.
NEW_STYLE_ENABLE = flag("enable", "switch the fused passes listed here on")


def _flag_and_configs(flag_name: str, configs: Section) -> tuple[tuple[str, str | Field], ...]:
    return (("enable", flag_name),) + tuple((f.name, f"{configs.name}.{f.name}") for f in configs.fields)


NEW_STYLE: tuple[tuple[str, bool, tuple[tuple[str, str | Field], ...]], ...] = (
    ("sharding", False, (("enable", "sharding"), ("stage", "sharding_configs.stage"),
                         ("degree", "sharding_configs.sharding_degree"))),
    ("fused_passes", True, (("enable", NEW_STYLE_ENABLE),
                            ("gemm_epilogue", "build_strategy.fuse_gemm_epilogue"),
                            ("dropout_add", "build_strategy.fuse_dropout_add"))),
    ("gradient_merge", False, _flag_and_configs("gradient_merge", GRADIENT_MERGE_CONFIGS)),
    ("pipeline", False, _flag_and_configs("pipeline", PIPELINE_CONFIGS)),
    ("amp", False, _flag_and_configs("amp", AMP_CONFIGS)),
    ("recompute", False, _flag_and_configs("recompute", RECOMPUTE_CONFIGS)),
)

# Paddle proto fields fleetc accepts with Paddle's defaults and reports as not applied, so that a prototxt Paddle
# wrote loads (fleetc/strategy/paddle_only.py).
BUILD_STRATEGY = extended_section(BUILD_STRATEGY)
DISTRIBUTED = with_paddle_fields(DISTRIBUTED)
PADDLE_ONLY_PATHS = paddle_only_paths()
