"""enable_inplace: the zoo matches eager and is bit-identical to enable_inplace off, alone and with recompute, gradient
merge, auto fusion and the multi-threaded scheduler; the planned peak never grows and matches the measured one."""
from __future__ import annotations

import pytest
from conftest import run_side_by_side
from zoo import ZOO

import fleetc


def _strategy(inplace: bool, **fields) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.enable_inplace = inplace
    for key, value in fields.items():
        setattr(strategy, key, value)
    return strategy




@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_zoo_matches_eager_and_the_bits_without_it(zoo_name):
    on = run_side_by_side(zoo_name, "adam", steps=3, strategy=_strategy(True), measure_memory=True)
    off = run_side_by_side(zoo_name, "adam", steps=3, strategy=_strategy(False), measure_memory=True)
    on.assert_same()
    on.assert_compiled_identical(off)
    assert on.trainer.report().stats["inplace_pointwise"]["ops_in_place"] > 0
    assert "build_strategy.enable_inplace" not in on.trainer.report().skipped
    planned_on, planned_off = on.trainer.memory_stats(), off.trainer.memory_stats()
    assert planned_on["estimated_peak_bytes"] <= planned_off["estimated_peak_bytes"]
    assert planned_on["measured_peak_bytes"] <= planned_off["measured_peak_bytes"]
    assert abs(planned_on["estimated_peak_bytes"] - planned_on["measured_peak_bytes"]) <= (
        0.10 * planned_on["measured_peak_bytes"])


COMBINATIONS = {
    "recompute": {"recompute": True, "recompute_configs": {"checkpoints": ["layers.0", "layers.1"]}},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
    "auto_fusion": {"build_strategy": {"enable_auto_fusion": True}},
    "threads": {"execution_strategy": {"num_threads": 4}},
}


@pytest.mark.parametrize("combination", [pytest.param(c, marks=[] if c == "threads" else [pytest.mark.slow])
                                         for c in sorted(COMBINATIONS)])
def test_gpt_with_dropout_keeps_its_bits_combined_with(combination):
    fields = COMBINATIONS[combination]
    steps = 4 if combination == "gradient_merge" else 2  # two updates of two merged steps
    on = run_side_by_side("gpt", "sgd", steps=steps, strategy=_strategy(True, **fields))
    off = run_side_by_side("gpt", "sgd", steps=steps, strategy=_strategy(False, **fields))
    if combination != "gradient_merge":  # eager updates every step; merged training matches eager accumulation,
        on.assert_same()                 # which tests/passes/test_gradient_merge.py checks for the run without it
    on.assert_compiled_identical(off)
    assert on.trainer.report().stats["inplace_pointwise"]["ops_in_place"] > 0
