"""The multi-threaded scheduler under 2-rank data parallel (gloo): collectives stay in one order on every rank, and
the results are bitwise those of one thread (and match single-process training)."""
from __future__ import annotations

import pytest
import torch

from fleet.spawn import assert_all_ok, spawn
from fleet.test_data_parallel import check_run

# One async allreduce per gradient, and one bucket that gradient producers write into (out= views of its buffer).
UNFUSED = {"fuse_all_reduce_ops": False, "sync_nccl_allreduce": False}
FUSED = {"sync_nccl_allreduce": False}
MERGE = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
CONFIGS = [
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": {**UNFUSED, "execution_strategy": {"num_threads": 1}}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": {**UNFUSED, "execution_strategy": {"num_threads": 4}}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": {**FUSED, "execution_strategy": {"num_threads": 4}}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 4, "strategy": {**MERGE, "execution_strategy": {"num_threads": 1}}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 4, "strategy": {**MERGE, "execution_strategy": {"num_threads": 2}}},
]


@pytest.mark.slow
def test_two_ranks_with_threads_give_the_bits_of_one_thread(tmp_path):
    results = spawn(2, "train_configs", {"configs": CONFIGS}, tmp_path, deadline_s=150)
    assert_all_ok(results)
    for i, config in enumerate(CONFIGS):
        check_run(results, i, 2, config)
    for result in results:
        one, four, fused, merged_one, merged_two = result.result["runs"]
        assert four["collectives"] == 6 and "multi-threaded scheduler, 4 compute threads" in four["execution"][0]
        assert fused["collectives"] == 1 and fused["report"]["allreduce_views"] == {"in_place": 6, "copied": 0}
        assert "multi-threaded scheduler, 2 compute threads" in merged_two["execution"][0]
        for single, threaded in ((one, four), (one, fused), (merged_one, merged_two)):
            assert all(torch.equal(a, b) for a, b in zip(single["losses"], threaded["losses"]))
            for name, value in single["state"].items():
                assert torch.equal(threaded["state"][name], value), name
