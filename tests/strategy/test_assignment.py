"""Assigning strategy fields the way Paddle users do: names, merges, copies, views and the newer Strategy."""

from __future__ import annotations

import copy
import pickle

import pytest

from fleetc.errors import StrategyError
from fleetc.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
    UnknownFieldError,
)


def test_unknown_field_names_the_closest_valid_one():
    strategy = DistributedStrategy()
    with pytest.raises(StrategyError, match="unknown DistributedStrategy field 'gradient_merg'; "
                                            "did you mean 'gradient_merge'"):
        strategy.gradient_merg = True
    assert strategy == DistributedStrategy()


def test_unknown_config_key_names_the_closest_valid_one():
    strategy = DistributedStrategy()
    strategy.gradient_merge_configs = {"k_steps": 2}
    with pytest.raises(StrategyError, match="unknown gradient_merge_configs key 'k_step'; did you mean 'k_steps'"):
        strategy.gradient_merge_configs = {"avg": False, "k_step": 4}
    assert strategy.gradient_merge_configs == {"k_steps": 2, "avg": True}


def test_field_of_a_section_set_at_top_level_says_where_it_lives():
    with pytest.raises(StrategyError, match="it lives at 'build_strategy.fuse_bn_act_ops'"):
        DistributedStrategy().fuse_bn_act_ops = True
    with pytest.raises(StrategyError, match="it lives at 'execution_strategy.num_threads'"):
        DistributedStrategy().num_threads = 3


def test_unknown_attribute_read_is_both_strategy_and_attribute_error():
    strategy = DistributedStrategy()
    assert not hasattr(strategy, "recompute_config")
    with pytest.raises(UnknownFieldError, match="did you mean 'recompute_configs'"):
        strategy.recompute_config  # noqa: B018
    assert isinstance(UnknownFieldError("x"), AttributeError)


def test_methods_cannot_be_overwritten():
    with pytest.raises(StrategyError, match="unknown DistributedStrategy field 'save_to_prototxt'"):
        DistributedStrategy().save_to_prototxt = None


def test_failed_config_assignment_applies_none_of_its_keys():
    strategy = DistributedStrategy()
    with pytest.raises(StrategyError, match="decr_ratio"):
        strategy.amp_configs = {"init_loss_scaling": 1024, "decr_ratio": 2.0}
    assert strategy.amp_configs["init_loss_scaling"] == 32768.0
    assert strategy == DistributedStrategy()


def test_config_dict_must_be_a_dict():
    with pytest.raises(StrategyError, match="gradient_merge_configs expects a dict with keys from"):
        DistributedStrategy().gradient_merge_configs = [("k_steps", 4)]


def test_configs_merge_into_current_values():
    strategy = DistributedStrategy()
    strategy.amp_configs = {"init_loss_scaling": 1024, "custom_white_list": ["matmul"]}
    strategy.amp_configs = {"incr_ratio": 3}
    configs = strategy.amp_configs
    assert configs["init_loss_scaling"] == 1024.0
    assert configs["custom_white_list"] == ["matmul"]
    assert configs["incr_ratio"] == 3.0


def test_reading_configs_gives_a_copy():
    strategy = DistributedStrategy()
    configs = strategy.recompute_configs
    configs["checkpoints"].append("x")
    configs["enable_offload"] = True
    assert strategy.recompute_configs["checkpoints"] == []
    assert strategy.recompute_configs["enable_offload"] is False
    strategy.recompute_configs = configs
    assert strategy.recompute_configs["checkpoints"] == ["x"]
    assert strategy.recompute_configs["enable_offload"] is True


def test_paddle_doc_snippets():
    strategy = DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["x", "y"]}
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
    strategy.lars = True
    strategy.lars_configs = {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0,
                             "exclude_from_weight_decay": ["batch_norm", ".b"]}
    strategy.lamb_configs = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []}
    strategy.localsgd = True
    strategy.localsgd_configs = {"k_steps": 4, "begin_step": 30}
    strategy.adaptive_localsgd_configs = {"init_k_steps": 1, "begin_step": 30}
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch": 12}
    assert strategy.recompute_configs["checkpoints"] == ["x", "y"]
    assert strategy.lars_configs["exclude_from_weight_decay"] == ["batch_norm", ".b"]
    assert strategy.lars_configs["epsilon"] == 0.0
    assert strategy.localsgd_configs == {"k_steps": 4, "begin_step": 30}
    assert strategy.adaptive_localsgd_configs["begin_step"] == 30
    assert strategy.pipeline_configs["micro_batch_size"] == 12
    assert "micro_batch" not in strategy.pipeline_configs


def test_alias_and_its_name_together_are_refused():
    with pytest.raises(StrategyError, match="given twice"):
        DistributedStrategy().pipeline_configs = {"micro_batch": 2, "micro_batch_size": 3}


def test_build_strategy_attribute_is_live():
    strategy = DistributedStrategy()
    strategy.build_strategy.fuse_bn_act_ops = True
    strategy.execution_strategy.num_threads = 4
    assert strategy.build_strategy.fuse_bn_act_ops is True
    assert strategy.to_dict()["execution_strategy"]["num_threads"] == 4
    with pytest.raises(StrategyError, match="unknown BuildStrategy field 'fuse_bn_act_op'"):
        strategy.build_strategy.fuse_bn_act_op = True


def test_assigning_a_build_strategy_copies_all_its_fields():
    strategy = DistributedStrategy()
    strategy.build_strategy.enable_inplace = True
    build = BuildStrategy()
    build.fuse_elewise_add_act_ops = True
    strategy.build_strategy = build
    build.fuse_bn_act_ops = True  # later changes to the source object do not leak in
    assert strategy.build_strategy.fuse_elewise_add_act_ops is True
    assert strategy.build_strategy.enable_inplace is False
    assert strategy.build_strategy.fuse_bn_act_ops is False


def test_build_strategy_accepts_a_dict_and_refuses_other_types():
    strategy = DistributedStrategy()
    strategy.execution_strategy = {"num_iteration_per_drop_scope": 30}
    assert strategy.execution_strategy.num_iteration_per_drop_scope == 30
    with pytest.raises(StrategyError, match=r"execution_strategy expects a dict or ExecutionStrategy\(\)"):
        strategy.execution_strategy = BuildStrategy()
    with pytest.raises(StrategyError, match="unknown execution_strategy key"):
        strategy.execution_strategy = {"num_thread": 2}


def test_copies_are_independent():
    strategy = DistributedStrategy()
    strategy.amp = True
    for duplicate in (copy.copy(strategy), copy.deepcopy(strategy), pickle.loads(pickle.dumps(strategy))):
        assert duplicate == strategy
        duplicate.amp = False
        assert strategy.amp is True


def test_copy_of_a_bound_view_is_standalone():
    strategy = DistributedStrategy()
    strategy.build_strategy.fuse_bn_act_ops = True
    build = copy.copy(strategy.build_strategy)
    build.fuse_bn_act_ops = False
    assert strategy.build_strategy.fuse_bn_act_ops is True
    assert isinstance(build, BuildStrategy)


def test_strategies_are_unhashable_but_comparable():
    with pytest.raises(TypeError):
        hash(DistributedStrategy())
    assert BuildStrategy() == BuildStrategy()
    assert BuildStrategy() != ExecutionStrategy()
    assert DistributedStrategy().build_strategy == BuildStrategy()


def test_new_style_strategy_attribute_access():
    strategy = Strategy()
    strategy.sharding.enable = True
    strategy.sharding.stage = 2
    strategy.sharding.degree = 2
    strategy.pipeline.schedule_mode = "FThenB"
    strategy.pipeline.micro_batch_size = 2
    assert strategy.sharding.stage == 2
    assert strategy.to_dict()["pipeline"] == {"enable": False, "micro_batch_size": 2, "accumulate_steps": 1,
                                              "schedule_mode": "FThenB", "vpp_degree": 1}
    with pytest.raises(StrategyError, match="Strategy.sharding.stage|sharding.stage must be one of 1, 2, 3"):
        strategy.sharding.stage = 5
    assert strategy.sharding.stage == 2
    with pytest.raises(StrategyError, match="did you mean 'gemm_epilogue'"):
        strategy.fused_passes.gemm_spilogue = True


def test_new_style_strategy_from_config_dict():
    strategy = Strategy({"gradient_merge": {"enable": True, "k_steps": 4}})
    assert strategy.gradient_merge.enable is True
    assert strategy.gradient_merge.k_steps == 4
    assert strategy.gradient_merge.avg is True
    assert strategy.sharding.degree == 8
    with pytest.raises(StrategyError, match="did you mean 'gradient_merge'"):
        Strategy({"gradient_merg": {"enable": True}})
    with pytest.raises(StrategyError, match="unknown gradient_merge key 'k_step'"):
        Strategy({"gradient_merge": {"k_step": 4}})
    with pytest.raises(StrategyError, match="expects a dict"):
        Strategy(["sharding"])


def test_new_style_list_fields_read_as_tuples_so_in_place_edits_fail_loudly():
    strategy = Strategy({"amp": {"enable": True, "custom_white_list": ["matmul"]}})
    assert strategy.amp.custom_white_list == ("matmul",)
    with pytest.raises(AttributeError):
        strategy.amp.custom_white_list.append("add")
