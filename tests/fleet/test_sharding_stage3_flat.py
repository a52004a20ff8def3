"""Sharding stage 3 on flat parameter buckets (passes/sharding/flat_params.py) on gloo ranks on loopback.

Each rank holds only its even piece of every parameter bucket, with the gradient shard and optimizer state of
that piece; training matches eager PyTorch accumulating over the same shards of the batch (losses and every
parameter, several steps; test_sharding.py's check), per-rank state bytes are within 10% of 16Ψ/N (Adam) and
12Ψ/N (SGD with momentum), `full_state_dict()` is whole on every rank, evaluation works, and checkpoints reshard
4 → 2 and 4 → 1 (2 → 2 and 2 → 1: test_sharding.py's round trip, under stage 3 flat too).
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers.export import trained
from zoo import ZOO

import fleetc
from fleet.spawn import assert_all_ok, spawn
from fleet.test_sharding import check_sharding, resume_in_one_process, sharded
from fleetc.fleet import inference
from fleetc.fleet.sharded_params import FlatShardedParameters

TINY_SEGMENTS = {"stage": 3, "segment_broadcast_MB": 0.0001}  # buckets of 104 bytes: most parameters alone, cut
ONE_PER_BUCKET = {"stage": 3, "segment_broadcast_MB": 1e-6}

# gpt × AdamW is left out against eager (test_sharding.py says why); FLEETC_FULL has the rest of the matrix
TWO_RANK_CONFIGS = [
    {"zoo": "gpt", "optimizer": "momentum", "steps": 3, "dropout_off": True,
     "strategy": sharded(3, sharding_configs=TINY_SEGMENTS)},
    {"zoo": "cnn", "optimizer": "adamw", "steps": 3, "strategy": sharded(3)},
    {"zoo": "mlp", "optimizer": "adam", "steps": 3, "strategy": sharded(3)},  # 16Ψ/N, the mlp one bucket
]
FULL_CONFIGS = [
    {"zoo": zoo, "optimizer": optimizer, "steps": 3, "dropout_off": True, "strategy": sharded(3, **extra)}
    for zoo in ("gpt", "cnn") for optimizer in ("momentum", "adam", "adamw") if (zoo, optimizer) != ("gpt", "adamw")
    for extra in ({}, {"sharding_configs": TINY_SEGMENTS})]


def check_flat(results, configs: list[dict], world: int) -> None:
    """test_sharding.py's checks, and that the parameters were held in flat pieces: every element on one rank."""
    check_sharding(results, configs, world)
    for i in range(len(configs)):
        runs = [r.result["runs"][i] for r in results]
        assert all("params_split" in run["report"]["sharding"] for run in runs)
        assert sum(run["held_param_elements"] for run in runs) == runs[0]["memory"]["parameters"]
        for run in runs:
            memory = run["memory"]
            assert memory["gathered_in_flight_bytes"] > 0, memory


@pytest.mark.slow
def test_flat_stage_3_on_two_ranks_matches_eager_training(tmp_path):
    results = spawn(2, "train_sharded", {"configs": TWO_RANK_CONFIGS}, tmp_path, deadline_s=300,
                    module="fleet.sharding_workers")
    check_flat(results, TWO_RANK_CONFIGS, 2)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="the zoo × optimizer matrix: FLEETC_FULL=1")
def test_flat_stage_3_full_matrix_on_two_ranks(tmp_path):
    results = spawn(2, "train_sharded", {"configs": FULL_CONFIGS}, tmp_path, deadline_s=900,
                    module="fleet.sharding_workers")
    check_flat(results, FULL_CONFIGS, 2)


@pytest.mark.slow
def test_a_rank_whose_piece_is_all_padding_trains_as_eager(tmp_path):
    results = spawn(2, "padded_pieces", {"strategy": sharded(3, sharding_configs=ONE_PER_BUCKET)}, tmp_path,
                    deadline_s=120, module="fleet.sharding_stage3_workers")
    assert_all_ok(results)
    ranks = [r.result for r in results]
    assert "2.bias" not in ranks[1]["pieces"] and ranks[1]["held"]["2.bias"] == 0  # all padding there
    assert ranks[0]["pieces"]["0.weight"] == [0, 20] and ranks[1]["pieces"]["0.weight"] == [20, 40]
    for step in range(3):
        torch.testing.assert_close(sum(r["losses"][step] for r in ranks) / 2, ranks[0]["eager_losses"][step])
    for r in ranks:
        for name, value in r["eager_state"].items():
            torch.testing.assert_close(r["state"][name], value, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(r["eval"], r["eager_eval"])
        torch.testing.assert_close(r["eval_before"], r["eager_eval_before"])
        assert r["eval_layout"] == "flat"  # recompiled after the training step released the parameters


@pytest.mark.slow
def test_four_ranks_match_eager_and_their_checkpoint_reshards_to_two_and_one(tmp_path):
    """4 ranks, one parameter per bucket (out.bias: 3, 3, 3 and 1 elements), train 2 steps as eager does and
    checkpoint; 2 ranks under stage 3 and one process resume it and train the third step alike."""
    checkpoint = str(tmp_path / "ckpt")
    configs = [{"zoo": "mlp", "optimizer": "adam", "steps": 2, "save": checkpoint,
                "strategy": sharded(3, sharding_configs=ONE_PER_BUCKET)}]
    written = spawn(4, "train_sharded", {"configs": configs}, tmp_path / "four", deadline_s=300,
                    module="fleet.sharding_workers")
    check_flat(written, configs, 4)
    single = resume_in_one_process(checkpoint)
    resumed = spawn(2, "checkpoint_round_trip", {"strategy": sharded(3), "load": checkpoint, "step_before_load": True},
                    tmp_path / "two", deadline_s=120, module="fleet.sharding_workers")
    assert_all_ok(resumed)
    for result in resumed:
        for name, value in single.items():
            torch.testing.assert_close(result.result["resumed"][name], value, msg=lambda m, name=name: f"{name}: {m}")
    shares = [result.result["state_elements"] for result in resumed]
    assert sum(shares) == 2 * 6922 and min(shares) > 0  # Adam's two moments, each rank its piece


def test_export_refuses_flat_pieces_by_name(tmp_path):
    """A rank holding flat pieces (1-D, not empty) is refused like one holding released parameters: the export
    would write pieces as weights."""
    strategy = fleetc.DistributedStrategy()
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 3}
    trainer, _, _ = trained(ZOO["mlp"], strategy, steps=1)
    names = [name for name, _ in trainer.model.named_parameters()]
    trainer._sharded_params = FlatShardedParameters(trainer.model, [names], {n: [0, 1] for n in names}, 0, 2)
    trainer._sharded_params.release()  # as rank 0 of 2 holds them: a piece of each
    assert trainer.model.fc2.weight.shape == (1,)
    with pytest.raises(fleetc.ExportError, match="this rank holds only its part of the parameters"):
        inference.save_inference_model(trainer, str(tmp_path / "m"), "x", "output")
