"""resolve_strategy and StrategyConfig: one frozen, hashable form for every strategy style; conflicts."""

from __future__ import annotations

import pickle

import pytest

from fleetc.errors import StrategyError
from fleetc.strategy import (
    BuildStrategy,
    Decision,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
    StrategyConfig,
    UnknownFieldError,
    resolve_conflicts,
    resolve_strategy,
)

from .fieldcases import FIELDS, PATHS, good_value, set_path


def test_none_gives_all_defaults():
    cfg = resolve_strategy(None)
    assert cfg == resolve_strategy(DistributedStrategy())
    assert cfg.to_dict() == DistributedStrategy().to_dict()
    assert cfg.explicit_fields == frozenset()
    assert cfg.a_sync is True and cfg.execution_strategy.num_iteration_per_drop_scope == 10


def test_attributes_use_distributed_strategy_names_and_tuples():
    strategy = DistributedStrategy()
    strategy.recompute = True
    strategy.recompute_configs = {"checkpoints": ["x", "y"]}
    strategy.amp_configs = {"custom_white_list": ["matmul"]}
    strategy.build_strategy.fuse_bn_act_ops = True
    strategy.execution_strategy.num_threads = 2
    cfg = resolve_strategy(strategy)
    assert cfg.recompute is True
    assert cfg.recompute_configs.checkpoints == ("x", "y")
    assert cfg.amp_configs.custom_white_list == ("matmul",)
    assert cfg.build_strategy.fuse_bn_act_ops is True
    assert cfg.execution_strategy.num_threads == 2
    assert cfg.gradient_merge_configs.k_steps == 1
    assert cfg.get("execution_strategy.num_threads") == 2
    assert cfg.explicit_fields == {"recompute", "recompute_configs.checkpoints", "amp_configs.custom_white_list",
                                   "build_strategy.fuse_bn_act_ops", "execution_strategy.num_threads"}


def test_config_is_frozen():
    cfg = resolve_strategy(None)
    with pytest.raises(AttributeError):
        cfg.amp = True
    with pytest.raises(AttributeError):
        cfg.amp_configs.incr_ratio = 3.0
    with pytest.raises(UnknownFieldError, match="did you mean 'k_steps'"):
        cfg.gradient_merge_configs.k_step  # noqa: B018
    with pytest.raises(UnknownFieldError, match="did you mean 'gradient_merge'"):
        cfg.gradient_merg  # noqa: B018


def test_equal_strategies_give_equal_equally_hashed_configs():
    first = DistributedStrategy()
    first.amp = True
    first.gradient_merge_configs = {"k_steps": 4}
    second = DistributedStrategy.from_dict({"gradient_merge_configs": {"k_steps": 4, "avg": True}, "amp": True})
    assert resolve_strategy(first) == resolve_strategy(second)
    assert hash(resolve_strategy(first)) == hash(resolve_strategy(second))
    assert len({resolve_strategy(first), resolve_strategy(second), resolve_strategy(None)}) == 2
    second.amp_configs = {"incr_ratio": 3}
    assert resolve_strategy(first) != resolve_strategy(second)


def test_every_field_reaches_the_config():
    strategy = DistributedStrategy()
    for path in PATHS:
        set_path(strategy, path, good_value(FIELDS[path]))
    cfg = resolve_strategy(strategy)
    assert cfg.to_dict() == strategy.to_dict()
    assert cfg.explicit_fields == set(PATHS)
    assert DistributedStrategy.from_dict(cfg.to_dict()) == strategy
    hash(cfg)


def test_config_pickles_and_replaces():
    cfg = resolve_strategy(Strategy({"amp": {"enable": True}}))
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert pickle.loads(pickle.dumps(cfg)).explicit_fields == cfg.explicit_fields
    changed = cfg.replace({"gradient_merge_configs.k_steps": 3})
    assert changed.gradient_merge_configs.k_steps == 3 and cfg.gradient_merge_configs.k_steps == 1
    assert changed.explicit_fields == cfg.explicit_fields
    with pytest.raises(StrategyError, match=">= 1"):
        cfg.replace({"gradient_merge_configs.k_steps": 0})
    with pytest.raises(StrategyError, match="unknown strategy path"):
        cfg.replace({"gradient_merge_configs.k_step": 2})


def test_build_and_execution_strategy_set_only_their_section():
    build = BuildStrategy()
    build.fuse_bn_act_ops = True
    cfg = resolve_strategy(build)
    assert cfg.build_strategy.fuse_bn_act_ops is True
    assert cfg.explicit_fields == {"build_strategy.fuse_bn_act_ops"}
    assert cfg.replace({"build_strategy.fuse_bn_act_ops": False}) == resolve_strategy(None)
    execution = ExecutionStrategy()
    execution.num_threads = 4
    assert resolve_strategy(execution) == StrategyConfig({"execution_strategy.num_threads": 4})


def test_new_style_strategy_maps_onto_distributed_fields():
    strategy = Strategy({"sharding": {"enable": True, "stage": 2, "degree": 4},
                         "gradient_merge": {"enable": True, "k_steps": 2, "avg": False},
                         "pipeline": {"enable": True, "micro_batch_size": 2, "accumulate_steps": 8,
                                      "schedule_mode": "FThenB"},
                         "amp": {"enable": True, "dtype": "bfloat16", "init_loss_scaling": 1024},
                         "recompute": {"enable": True, "checkpoints": "auto"},
                         "fused_passes": {"enable": True, "gemm_epilogue": True, "dropout_add": True}})
    expected = DistributedStrategy()
    expected.sharding = True
    expected.sharding_configs = {"stage": 2, "sharding_degree": 4}
    expected.gradient_merge = True
    expected.gradient_merge_configs = {"k_steps": 2, "avg": False}
    expected.pipeline = True
    expected.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 8, "schedule_mode": "FThenB"}
    expected.amp = True
    expected.amp_configs = {"dtype": "bfloat16", "init_loss_scaling": 1024}
    expected.recompute = True
    expected.recompute_configs = {"checkpoints": "auto"}
    expected.build_strategy.fuse_gemm_epilogue = True
    expected.build_strategy.fuse_dropout_add = True
    cfg = resolve_strategy(strategy)
    assert cfg == resolve_strategy(expected)
    assert cfg.explicit_fields == resolve_strategy(expected).explicit_fields


def test_fused_passes_apply_only_when_enabled():
    strategy = Strategy({"fused_passes": {"gemm_epilogue": True, "dropout_add": True}})
    cfg = resolve_strategy(strategy)
    assert cfg.build_strategy.fuse_gemm_epilogue is False
    assert cfg.build_strategy.fuse_dropout_add is False
    strategy.fused_passes.enable = True
    assert resolve_strategy(strategy).build_strategy.fuse_gemm_epilogue is True


def test_resolve_refuses_other_objects():
    with pytest.raises(StrategyError, match="got dict"):
        resolve_strategy({"amp": True})
    assert resolve_strategy(resolve_strategy(None)) == resolve_strategy(None)


def conflicts_of(**fields):
    return resolve_conflicts(resolve_strategy(DistributedStrategy.from_dict(fields)))


def test_no_decisions_for_defaults():
    cfg, decisions = resolve_conflicts(resolve_strategy(None))
    assert decisions == () and cfg == resolve_strategy(None)


def test_lars_and_lamb_together_is_an_error():
    with pytest.raises(StrategyError, match="lars and lamb"):
        conflicts_of(lars=True, lamb=True)


def test_adaptive_localsgd_wins_over_localsgd():
    cfg, decisions = conflicts_of(localsgd=True, adaptive_localsgd=True)
    assert cfg.localsgd is False and cfg.adaptive_localsgd is True
    assert decisions == (Decision("localsgd", "switched off", decisions[0].reason),)
    assert "adaptive_localsgd" in decisions[0].reason


def test_gradient_merge_with_pipeline_is_kept_and_reported_not_dropped():
    """Regression: gradient merge was switched off 'because pipeline accumulates', so k_steps=4 updated every
    step. Both stay on, and the decision states the rule (k_steps multiplies the update interval; the interval
    itself is tested in tests/passes/pipeline_parallel/test_split.py)."""
    cfg, decisions = conflicts_of(pipeline=True, gradient_merge=True, gradient_merge_configs={"k_steps": 4},
                                  pipeline_configs={"accumulate_steps": 3})
    assert cfg.gradient_merge and cfg.pipeline and cfg.gradient_merge_configs.k_steps == 4
    assert [str(d) for d in decisions] == [("gradient_merge: merged by the pipeline (with pipeline, k_steps multiplies "
                                            "the update interval: one update every 4 step() calls, i.e. every 4 × 3 "
                                            "micro-batches)")]


def test_gradient_merge_of_one_step_and_recompute_without_checkpoints_are_switched_off():
    cfg, decisions = conflicts_of(gradient_merge=True, recompute=True)
    assert cfg.gradient_merge is False and cfg.recompute is False
    assert [d.field for d in decisions] == ["gradient_merge", "recompute"]
    cfg, decisions = conflicts_of(recompute=True, recompute_configs={"checkpoints": "auto"})
    assert cfg.recompute is True and decisions == ()


def test_a_sync_is_reported_only_when_set():
    assert conflicts_of()[1] == ()
    _, decisions = conflicts_of(a_sync=True)
    assert [(d.field, d.action) for d in decisions] == [("a_sync", "ignored")]
    assert "parameter-server" in decisions[0].reason


def test_auto_is_ignored_with_a_decision():
    cfg, decisions = conflicts_of(auto=True)
    assert [(d.field, d.action) for d in decisions] == [("auto", "ignored")]
    assert "not implemented" in decisions[0].reason


def test_configs_set_while_switch_off_are_reported():
    _, decisions = conflicts_of(amp_configs={"init_loss_scaling": 128, "incr_ratio": 3})
    assert decisions == (Decision("amp_configs", "ignored", "init_loss_scaling, incr_ratio set but amp is False"),)
    _, decisions = conflicts_of(amp=True, amp_configs={"init_loss_scaling": 128})
    assert decisions == ()
