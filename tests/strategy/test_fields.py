"""Every field of the table: Paddle's default, a good value, wrong types and out-of-range values."""

from __future__ import annotations

import pytest

from fleetc.errors import StrategyError
from fleetc.strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy

from .fieldcases import (
    FIELDS,
    PATHS,
    get_path,
    good_value,
    out_of_range,
    set_path,
    wrong_types,
)

# Written out from reference/strategy_defaults.md (proto column), independently of the field table.
EXPECTED_DEFAULTS = {
    "a_sync": True, "a_sync_configs.k_steps": -1, "auto": False,
    "amp": False, "recompute": False, "localsgd": False, "adaptive_localsgd": False,
    "gradient_merge": False, "lars": False, "lamb": False, "pipeline": False, "sharding": False,
    "sync_nccl_allreduce": True, "nccl_comm_num": 1, "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 1, "sync_batch_norm": False, "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32, "fuse_grad_size_in_TFLOPS": 50, "last_comm_group_size_MB": 1.0,
    "find_unused_parameters": False, "cudnn_exhaustive_search": False, "conv_workspace_size_limit": 512,
    "cudnn_batchnorm_spatial_persistent": False,
    "recompute_configs.checkpoints": [], "recompute_configs.enable_offload": False,
    "recompute_configs.checkpoint_shape": [], "recompute_configs.memory_budget_mb": None,
    "amp_configs.init_loss_scaling": 32768.0, "amp_configs.incr_every_n_steps": 1000,
    "amp_configs.decr_every_n_nan_or_inf": 2, "amp_configs.incr_ratio": 2.0, "amp_configs.decr_ratio": 0.8,
    "amp_configs.use_dynamic_loss_scaling": True, "amp_configs.custom_white_list": [],
    "amp_configs.custom_black_list": [], "amp_configs.custom_black_varnames": [],
    "amp_configs.use_pure_fp16": False, "amp_configs.use_fp16_guard": True, "amp_configs.dtype": None,
    "gradient_merge_configs.k_steps": 1, "gradient_merge_configs.avg": True,
    "localsgd_configs.k_steps": 1, "localsgd_configs.begin_step": 1,
    "adaptive_localsgd_configs.init_k_steps": 1, "adaptive_localsgd_configs.begin_step": 1,
    "lars_configs.lars_coeff": 0.001, "lars_configs.lars_weight_decay": 0.0005, "lars_configs.epsilon": 0.0,
    "lars_configs.exclude_from_weight_decay": [],
    "lamb_configs.lamb_weight_decay": 0.01, "lamb_configs.exclude_from_weight_decay": [],
    "pipeline_configs.micro_batch_size": 1, "pipeline_configs.accumulate_steps": 1,
    "pipeline_configs.schedule_mode": "1F1B", "pipeline_configs.vpp_degree": 1,
    "sharding_configs.stage": 1, "sharding_configs.sharding_degree": 8, "sharding_configs.segment_broadcast_MB": 32.0,
    "hybrid_configs.dp_degree": -1, "hybrid_configs.mp_degree": 1, "hybrid_configs.pp_degree": 1,
    "hybrid_configs.sharding_degree": 1,
    "build_strategy.enable_sequential_execution": False, "build_strategy.fuse_elewise_add_act_ops": False,
    "build_strategy.fuse_bn_act_ops": False, "build_strategy.fuse_bn_add_act_ops": True,
    "build_strategy.fuse_gemm_epilogue": False, "build_strategy.fuse_dropout_add": False,
    "build_strategy.fuse_relu_depthwise_conv": False, "build_strategy.fuse_broadcast_ops": False,
    "build_strategy.fuse_all_optimizer_ops": False, "build_strategy.enable_inplace": False,
    "build_strategy.memory_optimize": False,
    "build_strategy.enable_backward_optimizer_op_deps": True, "build_strategy.enable_auto_fusion": False,
    "build_strategy.cache_runtime_context": False, "build_strategy.conv_channels_last": False,
    "execution_strategy.num_threads": 1, "execution_strategy.num_iteration_per_drop_scope": 10,
    "execution_strategy.num_iteration_per_run": 1, "execution_strategy.use_thread_barrier": False,
    # Paddle-only fields (accepted, reported as not applied), from Paddle's distributed_strategy.proto.
    "recompute_configs.enable_tuning": False, "amp_configs.use_optimizer_fp16": False,
    "amp_configs.use_pure_bf16": False,
    "sharding_configs.sharding_segment_strategy": "segment_broadcast_MB", "sharding_configs.segment_anchors": [],
    "sharding_configs.mp_degree": 1, "sharding_configs.dp_degree": 1, "sharding_configs.hybrid_dp": False,
    "sharding_configs.gradient_merge_acc_step": 1, "sharding_configs.optimize_offload": False,
    "sharding_configs.pp_allreduce_in_optimize": False, "sharding_configs.pp_degree": 1,
    "sharding_configs.optimize_cast": False, "sharding_configs._dp_as_optimizer_sharding": False,
    "sharding_configs.enable_tuning": False, "sharding_configs.use_calc_stream": False,
    "hybrid_configs.sep_degree": 1, "hybrid_configs.enable_optimizer_timer": False,
    "pipeline_configs.p2p_cache_shape": True, "pipeline_configs.enable_partial_send_recv": True,
    "build_strategy.enable_addto": False,
    "build_strategy.allow_cuda_graph_capture": False, "build_strategy.reduce_strategy": 0,
    "build_strategy.fused_attention": False, "build_strategy.fused_feedforward": False,
    "build_strategy.fuse_dot_product_attention": False, "build_strategy.fuse_resunit": False,
    "mode": "COLLECTIVE", "dgc": False, "dgc_configs.rampup_begin_step": 0, "dgc_configs.rampup_step": 1,
    "dgc_configs.sparsity": [], "elastic": False, "fp16_allreduce": False, "tensor_parallel": False,
    "tensor_parallel_configs.tensor_parallel_degree": 1, "tensor_parallel_configs.tensor_init_seed": -1,
    "without_graph_optimization": True, "fuse_grad_size_in_num": 8, "calc_comm_same_stream": False,
    "asp": False, "fuse_grad_merge": False, "semi_auto": False, "adam_d2sum": False, "auto_search": False,
    "heter_ccl_mode": False, "is_fl_ps_mode": False, "with_coordinator": False, "qat": False,
    "qat_configs.channel_wise_abs_max": True, "qat_configs.weight_bits": 8, "qat_configs.activation_bits": 8,
    "qat_configs.not_quant_pattern": [], "split_data": True,
    "a_sync_configs.max_merge_var_num": 1, "a_sync_configs.send_queue_size": 16,
    "a_sync_configs.independent_recv_thread": False, "a_sync_configs.min_send_grad_num_before_recv": 1,
    "a_sync_configs.thread_pool_size": 1, "a_sync_configs.send_wait_times": 1,
    "a_sync_configs.runtime_split_send_recv": False, "a_sync_configs.launch_barrier": True,
    "a_sync_configs.lr_decay_steps": 10, "a_sync_configs.use_ps_gpu": 0, "a_sync_configs.use_gpu_graph": 0,
    "gradient_scale_configs.scale_strategy": "avg", "gradient_scale_configs.scale_gradient": False,
    "a_sync_configs.heter_worker_device_guard": "cpu", "build_strategy.debug_graphviz_path": "", "qat_configs.algo": "",
    "hybrid_configs.mp_configs": {}, "hybrid_configs.pp_configs": {}, "hybrid_configs.sharding_configs": {},
    "recompute_configs.refined_ops_patterns": [], "trainer_desc_configs": {}, "downpour_table_param": [],
    "fs_client_param": {},
}


def test_table_covers_exactly_the_expected_fields():
    assert set(FIELDS) == set(EXPECTED_DEFAULTS)


@pytest.mark.parametrize("path", PATHS)
def test_default_matches_paddle_proto(path):
    value = DistributedStrategy().to_dict()
    for part in path.split("."):
        value = value[part]
    expected = EXPECTED_DEFAULTS[path]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("path", PATHS)
def test_good_value_is_accepted(path):
    strategy = DistributedStrategy()
    value = good_value(FIELDS[path])
    set_path(strategy, path, value)
    got = get_path(strategy, path)
    assert list(got) == value if isinstance(value, list) else got == value
    assert strategy != DistributedStrategy()


@pytest.mark.parametrize("path", PATHS)
def test_wrong_type_is_rejected_naming_the_field(path):
    for value in wrong_types(FIELDS[path]):
        strategy = DistributedStrategy()
        with pytest.raises(StrategyError) as info:
            set_path(strategy, path, value)
        assert path in str(info.value)
        assert strategy == DistributedStrategy()


@pytest.mark.parametrize("path", [p for p in PATHS if out_of_range(FIELDS[p])])
def test_out_of_range_is_rejected(path):
    for value in out_of_range(FIELDS[path]):
        strategy = DistributedStrategy()
        with pytest.raises(StrategyError, match=path.replace(".", r"\.")):
            set_path(strategy, path, value)
        assert strategy == DistributedStrategy()


@pytest.mark.parametrize(("path", "value", "message"), [
    ("gradient_merge_configs.k_steps", 0, ">= 1"),
    ("sharding_configs.stage", 4, "one of 1, 2, 3"),
    ("sharding_configs.stage", 0, "one of 1, 2, 3"),
    ("fuse_grad_size_in_MB", -1, ">= 1"),
    ("conv_workspace_size_limit", -1, ">= 0"),
    ("pipeline_configs.schedule_mode", "1f1b", "did you mean '1F1B'"),
    ("pipeline_configs.micro_batch_size", 0, ">= 1"),
    ("execution_strategy.num_threads", 0, ">= 1"),
    ("amp_configs.incr_ratio", 1.0, "> 1"),
    ("amp_configs.decr_ratio", 1.0, "< 1"),
    ("amp_configs.decr_ratio", 0, "> 0"),
    ("amp_configs.init_loss_scaling", -2.0, "> 0"),
    ("last_comm_group_size_MB", 0, "> 0"),
    ("recompute_configs.memory_budget_mb", 0, "> 0"),
    ("amp_configs.dtype", "float32", "'float16', 'bfloat16'"),
])
def test_named_ranges(path, value, message):
    with pytest.raises(StrategyError, match=message):
        set_path(DistributedStrategy(), path, value)


def test_bool_is_not_an_int_but_an_int_is_a_float():
    strategy = DistributedStrategy()
    with pytest.raises(StrategyError, match="nccl_comm_num expects int, got bool True"):
        strategy.nccl_comm_num = True
    strategy.amp_configs = {"init_loss_scaling": 128}
    assert strategy.amp_configs["init_loss_scaling"] == 128.0
    assert type(strategy.amp_configs["init_loss_scaling"]) is float


def test_list_items_are_checked():
    strategy = DistributedStrategy()
    with pytest.raises(StrategyError, match="expects a list of str"):
        strategy.amp_configs = {"custom_white_list": "matmul"}
    with pytest.raises(StrategyError, match="empty"):
        strategy.amp_configs = {"custom_white_list": [""]}
    strategy.amp_configs = {"custom_white_list": ("matmul", "add")}
    assert strategy.amp_configs["custom_white_list"] == ["matmul", "add"]


def test_checkpoints_accept_auto_but_not_mixed_with_names():
    strategy = DistributedStrategy()
    strategy.recompute_configs = {"checkpoints": "auto"}
    assert strategy.recompute_configs["checkpoints"] == "auto"
    strategy.recompute_configs = {"checkpoints": ["auto"]}
    assert strategy.recompute_configs["checkpoints"] == "auto"
    with pytest.raises(StrategyError, match="cannot be mixed"):
        strategy.recompute_configs = {"checkpoints": ["auto", "fc1"]}


@pytest.mark.parametrize(("cls", "expected"), [
    (BuildStrategy, {name.split(".")[1]: v for name, v in EXPECTED_DEFAULTS.items()
                     if name.startswith("build_strategy.")}),
    (ExecutionStrategy, {name.split(".")[1]: v for name, v in EXPECTED_DEFAULTS.items()
                         if name.startswith("execution_strategy.")}),
])
def test_standalone_build_and_execution_strategy_defaults_and_checks(cls, expected):
    obj = cls()
    assert obj.to_dict() == expected
    name = next(iter(expected))
    with pytest.raises(StrategyError, match=name):
        setattr(obj, name, "wrong")
    assert obj == cls()
