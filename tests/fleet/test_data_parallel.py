"""Data-parallel training in 2 and 4 processes on loopback (gloo) matches single-process training on the full batch."""
from __future__ import annotations

import pytest
import torch
from zoo import OPTIMIZERS, ZOO

from fleet.spawn import assert_all_ok, spawn
from fleet.workers import global_batches, make_model, shard


def reference(config: dict, world: int, initial: dict, per_shard_batch_norm: bool) -> tuple[list, dict]:
    """Single-process eager training from the same initial state.

    Without BatchNorm the full-batch loss is the mean of the equal shards' losses, so one step on the full
    batch is the data-parallel step. With BatchNorm (cnn) every rank normalizes with its own shard's
    statistics (sync_batch_norm off, as in torch DDP), so the reference averages the shards' losses, each
    computed with its own forward pass; running statistics then differ by design and are not compared.
    With sync_batch_norm the full batch is the reference again, running statistics included. With
    gradient merge the reference accumulates `loss / k_steps` and updates every k_steps steps.
    """
    entry = ZOO[config["zoo"]]
    model = make_model(config)
    model.load_state_dict(initial)
    opt = OPTIMIZERS[config["optimizer"]](model.parameters())
    merge = config["strategy"].get("gradient_merge_configs", {}).get("k_steps", 1)
    losses = []
    for step, batch in enumerate(global_batches(config["zoo"], config["steps"])):
        if step % merge == 0:
            opt.zero_grad(set_to_none=True)
        if per_shard_batch_norm:
            loss = sum(entry.loss_fn(model(*shard(batch, r, world)[:-1]), shard(batch, r, world)[-1])
                       for r in range(world)) / world
        else:
            loss = entry.loss_fn(model(*batch[:-1]), batch[-1])
        (loss / merge).backward()
        if (step + 1) % merge == 0:
            opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def check_run(results, index: int, world: int, config: dict, per_shard: bool = False, atol: float = 1e-6) -> None:
    """`per_shard`: the reference sums each shard's own forward and backward, as the ranks do (rounding as they do);
    `atol`: for the parameters."""
    runs = [r.result["runs"][index] for r in results]
    per_shard_batch_norm = config["zoo"] == "cnn" and not config["strategy"].get("sync_batch_norm")
    for run in runs[1:]:
        for name, value in runs[0]["state"].items():
            assert torch.equal(run["state"][name], value) or (per_shard_batch_norm and "running" in name), name
        for name, value in runs[0]["initial"].items():
            assert torch.equal(run["initial"][name], value), f"{name} was not broadcast from rank 0"
    losses, state = reference(config, world, runs[0]["initial"], per_shard_batch_norm or per_shard)
    mean_losses = [sum(run["losses"][i] for run in runs) / world for i in range(config["steps"])]
    for step, (got, want) in enumerate(zip(mean_losses, losses)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss of step {step}: {m}")
    for name, want in state.items():
        if per_shard_batch_norm and ("running" in name or "num_batches" in name):  # the reference ran BN twice
            continue
        torch.testing.assert_close(runs[0]["state"][name], want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(runs[0]["state"][k], v) for k, v in runs[0]["initial"].items()), "nothing trained"


TWO_RANK_CONFIGS = [
    {"zoo": "mlp", "optimizer": "adamw", "steps": 2, "strategy": {}},
    {"zoo": "mlp", "optimizer": "momentum", "steps": 2, "strategy": {"fuse_all_reduce_ops": False}},
    {"zoo": "cnn", "optimizer": "momentum", "steps": 2,
     "strategy": {"sync_nccl_allreduce": False, "nccl_comm_num": 2, "last_comm_group_size_MB": 0.001,
                  "fuse_grad_size_in_TFLOPS": 4}},
    # SGD, not Adam: statistics summed over ranks round differently from one pass over the full batch, and
    # Adam's normalization turns a 1e-9 difference in a near-zero gradient into a 1e-6 parameter difference.
    {"zoo": "cnn", "optimizer": "momentum", "steps": 2, "strategy": {"sync_batch_norm": True}},
    # Dropout off: each rank draws masks for its own shard from its own RNG stream, which no single-process
    # run on the full batch reproduces; everything else about gpt (LayerNorm, GELU, tied embeddings) is kept.
    {"zoo": "gpt", "optimizer": "momentum", "steps": 2, "dropout_off": True,
     "strategy": {"fuse_grad_size_in_TFLOPS": 8, "sync_nccl_allreduce": False}},
    # Two updates of two merged steps each: each rank accumulates its own gradients, allreduced once per update.
    {"zoo": "mlp", "optimizer": "momentum", "steps": 4,
     "strategy": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}},
]


@pytest.mark.slow
def test_two_ranks_match_single_process_training(tmp_path):
    results = spawn(2, "train_configs", {"configs": TWO_RANK_CONFIGS}, tmp_path, deadline_s=150)
    assert_all_ok(results)
    assert [r.result["index"] for r in results] == [0, 1]
    assert all(r.result["num"] == 2 and len(r.result["endpoints"]) == 2 for r in results)
    for i, config in enumerate(TWO_RANK_CONFIGS):
        check_run(results, i, 2, config)
    fused, unfused, cnn, synced, gpt, merged = results[0].result["runs"]
    assert fused["collectives"] == 1  # all 27 KB of gradients fit the 1 MB first bucket
    assert fused["report"]["allreduce_views"] == {"in_place": 6, "copied": 0}
    assert unfused["collectives"] == 6  # one per gradient
    assert cnn["collectives"] == 5 and cnn["report"]["fuse_all_reduce_ops"]["buckets"] == 5  # 17 grads, ≤ 4 each
    assert cnn["report"]["overlap_allreduce"]["waits_moved"] == 5
    assert cnn["report"]["allreduce_views"] == {"in_place": 2, "copied": 15}  # conv and bn backward: no out kernel
    assert set(cnn["groups"]) == {"dp:0", "dp:1"}
    assert synced["report"]["sync_batch_norm"] == {"batch_norms_synced": 5, "backwards_synced": 5}
    assert gpt["collectives"] == 4 and gpt["report"]["allreduce_views"] == {"in_place": 17, "copied": 11}
    # one bucket of the merged gradients, allreduced in the update block: once per 2 steps
    assert merged["collectives"] == 1 and merged["report"]["fuse_all_reduce_ops"]["collectives_per_k_steps"] == 1
    assert merged["start_blocks"] == [merged["update_block"]] and fused["start_blocks"] == [0]
    torch.manual_seed(0)
    _, eager_state = reference({"zoo": "mlp", "optimizer": "sgd", "steps": 2, "strategy": {}}, 2,
                               ZOO["mlp"].make_model().state_dict(), False)
    for name, want in eager_state.items():
        torch.testing.assert_close(results[1].result["eager"]["state"][name], want, rtol=1e-5, atol=1e-6)


FOUR_RANK_CONFIGS = [
    {"zoo": "mlp", "optimizer": "sgd", "steps": 2,
     "strategy": {"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 2, "nccl_comm_num": 2,
                  "fuse_grad_size_in_TFLOPS": 2, "sync_nccl_allreduce": False}},
    {"zoo": "cnn", "optimizer": "adam", "steps": 2, "strategy": {}},
]


@pytest.mark.slow
def test_four_ranks_hierarchical_and_two_communicators(tmp_path):
    results = spawn(4, "train_configs", {"configs": FOUR_RANK_CONFIGS}, tmp_path, deadline_s=150)
    assert_all_ok(results)
    for i, config in enumerate(FOUR_RANK_CONFIGS):
        check_run(results, i, 4, config)
    hierarchical = results[0].result["runs"][0]
    assert hierarchical["groups"]["intra:0"] == [[0, 1], [2, 3]]
    assert hierarchical["groups"]["inter:1"] == [[0, 2], [1, 3]]
    assert hierarchical["collectives"] == 3


PURE_LOW_PRECISION = {"zoo": "mlp", "optimizer": "momentum", "steps": 3,
                      "strategy": {"amp": True, "amp_configs": {"use_pure_fp16": True, "use_fp16_guard": False,
                                                                "dtype": "bfloat16"}}}


FP16_ALLREDUCE = {"zoo": "mlp", "optimizer": "momentum", "steps": 3, "strategy": {"fp16_allreduce": True}}


@pytest.mark.slow
def test_pure_low_precision_ranks_update_from_the_averaged_gradient(tmp_path):
    """`use_pure_fp16`: the gradients are averaged in bfloat16 and the float32 master weights updated from the cast
    of the average, taken after it (low_precision.py; the cast AMP puts in backward, where a gradient read means
    the rank's own value, once read that, and the ranks drifted apart). `fp16_allreduce` (float32 parameters):
    every gradient averaged in bfloat16 and cast back. Both within bfloat16 tolerance of float32 eager training."""
    results = spawn(2, "train_configs", {"configs": [PURE_LOW_PRECISION, FP16_ALLREDUCE]}, tmp_path, deadline_s=150)
    assert_all_ok(results)
    for index, config in enumerate((PURE_LOW_PRECISION, FP16_ALLREDUCE)):
        runs = [r.result["runs"][index] for r in results]
        assert any(not torch.equal(runs[0]["state"][k], v.to(runs[0]["state"][k].dtype))
                   for k, v in runs[0]["initial"].items()), "nothing trained"
        for name, value in runs[0]["state"].items():
            assert torch.equal(runs[1]["state"][name], value), f"{name}: the ranks' parameters differ"
        losses, state = reference(config, 2, runs[0]["initial"], False)
        mean = [sum(run["losses"][step] for run in runs) / 2 for step in range(config["steps"])]
        torch.testing.assert_close(torch.stack(mean), torch.stack(losses), rtol=2e-2, atol=1e-2)
        for name, want in state.items():  # (bfloat16) parameters against float32 eager on the full batch
            torch.testing.assert_close(runs[0]["state"][name].float(), want, rtol=2e-2, atol=1e-2,
                                       msg=lambda m, name=name: f"{name}: {m}")
    allreduced = results[0].result["runs"][1]
    assert allreduced["report"]["insert_allreduce"]["fp16_allreduce_gradients"] == 6
    assert all(value.dtype == torch.float32 for value in allreduced["state"].values())
