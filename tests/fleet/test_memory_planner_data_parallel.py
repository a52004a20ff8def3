"""The memory planner (enable_inplace + memory_optimize) under 2-rank data parallel (gloo), with gradients written
into their bucket's buffer and with the multi-threaded scheduler: the bits of the run without the planner."""
from __future__ import annotations

import pytest
import torch

from fleet.spawn import assert_all_ok, spawn
from fleet.test_data_parallel import check_run

FUSED = {"sync_nccl_allreduce": False}  # one bucket that gradient producers write into (out= views of its buffer)
PLANNER = {"build_strategy": {"enable_inplace": True, "memory_optimize": True}}
CONFIGS = [
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": FUSED},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": {**FUSED, **PLANNER}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2,
     "strategy": {**FUSED, **PLANNER, "execution_strategy": {"num_threads": 4}}},
]


@pytest.mark.slow
def test_two_ranks_with_the_planner_give_the_bits_without_it(tmp_path):
    results = spawn(2, "train_configs", {"configs": CONFIGS}, tmp_path, deadline_s=150)
    assert_all_ok(results)
    for i, config in enumerate(CONFIGS):
        check_run(results, i, 2, config)
    for result in results:
        plain, planned, threaded = result.result["runs"]
        assert planned["report"]["reuse_buffers"]["buffers_reused"] > 0
        assert planned["report"]["allreduce_views"] == plain["report"]["allreduce_views"]
        for run in (planned, threaded):
            assert all(torch.equal(a, b) for a, b in zip(plain["losses"], run["losses"]))
            for name, value in plain["state"].items():
                assert torch.equal(run["state"][name], value), name
