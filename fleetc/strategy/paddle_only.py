"""Fields of Paddle's ``distributed_strategy.proto`` that fleetc accepts but does not implement.

They are in the field table with Paddle's defaults so that a prototxt or dict Paddle wrote loads (instead of being
refused as unknown names); names Paddle does not have still get the strict did-you-mean error. A value other than
the default is reported by ``report()`` as not applied (fleetc.passes.order). The free-text fields
(``qat_configs.algo``, ``a_sync_configs.heter_worker_device_guard``, ``build_strategy.debug_graphviz_path``) are
strings; the nested and parameter-server messages (``hybrid_configs.mp_configs`` / ``pp_configs`` /
``sharding_configs``, ``recompute_configs.refined_ops_patterns``, ``trainer_desc_configs``,
``downpour_table_param``, ``fs_client_param``) are kept as data without checking their inner names
(fleetc.strategy.messages).
"""

from __future__ import annotations

from dataclasses import replace

from fleetc.strategy.field_types import (
    BOOL,
    COUNT,
    NAMES,
    SIZE,
    Field,
    FieldOrSection,
    Section,
    flag,
)
from fleetc.strategy.kinds import Bounds, Choice, Int, ListOf, Text
from fleetc.strategy.messages import Message, MessageValue

TEXT = Text()
_FROM = Int(Bounds(ge=-1))  # -1 means "not set" in these Paddle fields

# Extra fields of sections fleetc already has: section name -> fields.
EXTRA_SECTION_FIELDS: dict[str, tuple[Field, ...]] = {
    "a_sync_configs": (  # k_steps is fleetc's own (parameter-server geo mode)
        Field("max_merge_var_num", COUNT, 1, "Paddle: gradients merged per send"),
        Field("send_queue_size", COUNT, 16, "Paddle: send queue length"),
        flag("independent_recv_thread", "Paddle: receive on a thread of its own"),
        Field("min_send_grad_num_before_recv", COUNT, 1, "Paddle: sends before a receive"),
        Field("thread_pool_size", COUNT, 1, "Paddle: communicator threads"),
        Field("send_wait_times", COUNT, 1, "Paddle: waits before a send"),
        flag("runtime_split_send_recv", "Paddle: split send/recv at run time"),
        flag("launch_barrier", "Paddle: barrier at launch", True),
        Field("lr_decay_steps", COUNT, 10, "Paddle: learning-rate decay interval"),
        Field("use_ps_gpu", SIZE, 0, "Paddle: GPU parameter server"),
        Field("use_gpu_graph", SIZE, 0, "Paddle: GPU graph engine"),
        Field("heter_worker_device_guard", TEXT, "cpu", "Paddle: device of heterogeneous parameter-server workers"),
    ),
    "recompute_configs": (
        flag("enable_tuning", "Paddle: auto-parallel recompute tuning"),
        Field("refined_ops_patterns", Message(repeated=True), (), "Paddle: ops excluded from recompute, by pattern"),
    ),
    "amp_configs": (
        flag("use_optimizer_fp16", "Paddle: keep optimizer state in fp16 (auto parallel only)"),
        flag("use_pure_bf16", "Paddle: pure bf16 training (fleetc: use_pure_fp16 with dtype bfloat16)"),
    ),
    "sharding_configs": (
        Field("sharding_segment_strategy", Choice(("segment_broadcast_MB", "segment_anchors")),
              "segment_broadcast_MB", "Paddle: how sharded parameters are cut into broadcast segments"),
        Field("segment_anchors", NAMES, (), "Paddle: var names where segments are cut"),
        Field("mp_degree", COUNT, 1, "Paddle: tensor-parallel degree inside sharding"),
        Field("dp_degree", COUNT, 1, "Paddle: data-parallel degree beside sharding"),
        flag("hybrid_dp", "Paddle: data parallel across sharding groups"),
        Field("gradient_merge_acc_step", COUNT, 1, "Paddle: gradient merge steps inside sharding"),
        flag("optimize_offload", "Paddle: offload optimizer state to host memory"),
        flag("pp_allreduce_in_optimize", "Paddle: allreduce in the optimize stage under pipeline"),
        Field("pp_degree", COUNT, 1, "Paddle: pipeline degree inside sharding"),
        flag("optimize_cast", "Paddle: cast parameters in the optimizer step"),
        flag("_dp_as_optimizer_sharding", "Paddle: data parallel used as optimizer sharding"),
        flag("enable_tuning", "Paddle: auto-parallel sharding tuning"),
        flag("use_calc_stream", "Paddle: run sharding collectives on the compute stream"),
    ),
    "hybrid_configs": (
        Field("sep_degree", COUNT, 1, "Paddle: sequence-parallel degree"),
        flag("enable_optimizer_timer", "Paddle: time the optimizer step"),
        Field("mp_configs", Message(), MessageValue(), "Paddle: tensor-parallel settings"),
        Field("pp_configs", Message(), MessageValue(), "Paddle: dygraph pipeline settings"),
        Field("sharding_configs", Message(), MessageValue(), "Paddle: dygraph sharding settings"),
    ),
    "pipeline_configs": (
        flag("p2p_cache_shape", "Paddle: cache the shapes of pipeline send/recv", True),
        flag("enable_partial_send_recv", "Paddle: send only a slice between pipeline stages", True),
    ),
    "build_strategy": (
        flag("enable_addto", "Paddle: accumulate gradients in place with addto"),
        flag("allow_cuda_graph_capture", "Paddle: allow capturing the program as a CUDA graph"),
        Field("reduce_strategy", SIZE, 0, "Paddle: 0 allreduce, 1 reduce to one device"),
        flag("fused_attention", "Paddle: fuse multi-head attention"),
        flag("fused_feedforward", "Paddle: fuse the transformer feed-forward block"),
        flag("fuse_dot_product_attention", "Paddle: fuse dot-product attention"),
        flag("fuse_resunit", "Paddle: fuse ResNet residual units"),
        Field("debug_graphviz_path", TEXT, "", "Paddle: write the graph as graphviz files under this path"),
    ),
}

# Top-level switches and their sections, appended after fleetc's own fields.
EXTRA_ENTRIES: tuple[FieldOrSection, ...] = (
    Field("mode", Choice(("COLLECTIVE", "PS", "PIPELINE", "HETER")), "COLLECTIVE", "Paddle: the training mode"),
    flag("dgc", "Paddle: deep gradient compression"),
    Section("dgc_configs", (
        Field("rampup_begin_step", SIZE, 0, "Paddle: step at which DGC starts"),
        Field("rampup_step", COUNT, 1, "Paddle: steps over which sparsity ramps up"),
        Field("sparsity", ListOf(float), (), "Paddle: the sparsity schedule"),
    ), "Paddle: deep gradient compression settings"),
    flag("elastic", "Paddle: elastic training"),
    flag("tensor_parallel", "Paddle: tensor (model) parallelism"),
    Section("tensor_parallel_configs", (
        Field("tensor_parallel_degree", COUNT, 1, "Paddle: tensor-parallel degree"),
        Field("tensor_init_seed", _FROM, -1, "Paddle: seed for tensor-parallel parameter init"),
    ), "Paddle: tensor parallel settings"),
    Field("without_graph_optimization", BOOL, True, "Paddle: skip the graph-optimization meta optimizer"),
    Field("fuse_grad_size_in_num", COUNT, 8, "Paddle: gradients per fused buffer (without graph optimization)"),
    flag("calc_comm_same_stream", "Paddle: run collectives on the compute stream"),
    flag("asp", "Paddle: automatic structured (2:4) sparsity"),
    flag("fuse_grad_merge", "Paddle: fuse gradient merge buffers"),
    flag("semi_auto", "Paddle: semi-automatic parallelism"),
    flag("adam_d2sum", "Paddle: parameter-server Adam variant"),
    flag("auto_search", "Paddle: automatic parallel strategy search"),
    flag("heter_ccl_mode", "Paddle: heterogeneous collective training"),
    flag("is_fl_ps_mode", "Paddle: federated parameter-server mode"),
    flag("with_coordinator", "Paddle: federated learning coordinator"),
    flag("qat", "Paddle: quantization-aware training"),
    Section("qat_configs", (
        flag("channel_wise_abs_max", "Paddle: per-channel weight quantization", True),
        Field("weight_bits", COUNT, 8, "Paddle: weight quantization bits"),
        Field("activation_bits", COUNT, 8, "Paddle: activation quantization bits"),
        Field("not_quant_pattern", NAMES, (), "Paddle: name patterns left unquantized"),
        Field("algo", TEXT, "", "Paddle: the quantization algorithm"),
    ), "Paddle: quantization-aware training settings"),
    flag("split_data", "Paddle: split the data across parameter-server workers", True),
    Section("gradient_scale_configs", (
        Field("scale_strategy", Choice(("avg", "sum", "customized")), "avg",
              "Paddle: how the loss gradient is scaled across devices"),
        flag("scale_gradient", "Paddle: scale after gradient merge instead of before"),
    ), "Paddle: gradient scaling settings"),
    Field("trainer_desc_configs", Message(), MessageValue(), "Paddle: parameter-server trainer dump settings"),
    Field("downpour_table_param", Message(repeated=True), (), "Paddle: parameter-server table settings"),
    Field("fs_client_param", Message(), MessageValue(), "Paddle: parameter-server file-system client settings"),
)


def paddle_only_paths() -> frozenset[str]:
    """The dotted paths of every field this module adds."""
    paths = {f"{section}.{f.name}" for section, extra in EXTRA_SECTION_FIELDS.items() for f in extra}
    for entry in EXTRA_ENTRIES:
        paths |= ({f"{entry.name}.{f.name}" for f in entry.fields} if isinstance(entry, Section) else {entry.name})
    return frozenset(paths)


def with_paddle_fields(entries: tuple[FieldOrSection, ...]) -> tuple[FieldOrSection, ...]:
    """`entries` with the Paddle-only fields added to their sections and the Paddle-only entries appended."""
    extended = tuple(replace(e, fields=e.fields + EXTRA_SECTION_FIELDS[e.name])
                     if isinstance(e, Section) and e.name in EXTRA_SECTION_FIELDS else e for e in entries)
    return extended + EXTRA_ENTRIES


def extended_section(section: Section) -> Section:
    """`section` with its Paddle-only fields (for the standalone BuildStrategy)."""
    return replace(section, fields=section.fields + EXTRA_SECTION_FIELDS.get(section.name, ()))
