"""Sharding stage 3 on flat parameter buckets (passes/sharding/flat_params.py) on gloo ranks on loopback.

Each rank holds only its even piece of every parameter bucket, with the gradient shard and optimizer state of
that piece; training matches eager PyTorch accumulating over the same shards of the batch (losses and every
parameter, several steps; test_sharding.py's check), per-rank state bytes are within 10% of 16Ψ/N (Adam) and
12Ψ/N (SGD with momentum), `full_state_dict()` is whole on every rank, evaluation works, and checkpoints reshard
4 → 2 and 4 → 1 (2 → 2 and 2 → 1: test_sharding.py's round trip, under stage 3 flat too). Under use_pure_fp16
each rank holds its piece of the bfloat16 parameters, of the float32 master weights and of the moments, and
stages 1, 2 and 3 train bit for bit as unsharded use_pure_fp16 data parallel does.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers.export import trained
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import assert_all_ok, spawn
from fleet.test_data_parallel import check_run
from fleet.test_sharding import (
    FP32_ATOL,
    PURE_BF16,
    check_sharding,
    clipped,
    resume_in_one_process,
    sharded,
)
from fleet.workers import global_batches, make_model, make_strategy, shard
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

# use_pure_fp16: unsharded data parallel, then stages 1, 2, 3 on the mlp (Adam); data parallel, then stage 3 on gpt
PURE_CONFIGS = [{"zoo": zoo, "optimizer": optimizer, "steps": 3, "dropout_off": True,
                 "strategy": dict(PURE_BF16, **(sharded(stage) if stage else {}))}
                for zoo, optimizer, stages in (("mlp", "adam", (0, 1, 2, 3)), ("gpt", "adam", (0, 1, 2, 3)))
                for stage in stages]


def pure_low_precision_reference(config: dict, world: int, initial: dict) -> dict:
    """Eager use_pure_fp16 on the same shards: a bfloat16 copy of the model runs each shard's forward and backward
    (the loss in float32), the shards' bfloat16 gradients are averaged in bfloat16 (as Paddle and torch DDP
    communicate a bfloat16 parameter's gradient), the average is cast to float32 and the optimizer updates float32
    master weights, which are rounded into the bfloat16 parameters. Returns (the mean loss of each step, the state)."""
    entry = ZOO[config["zoo"]]
    master = make_model(config)
    master.load_state_dict(initial)
    low = copy.deepcopy(master).to(torch.bfloat16)
    opt = OPTIMIZERS[config["optimizer"]](master.parameters())
    losses = []
    for batch in global_batches(config["zoo"], config["steps"]):
        grads = [torch.zeros_like(p) for p in low.parameters()]
        losses.append(torch.zeros(()))
        for rank in range(world):
            *inputs, target = shard(batch, rank, world)
            low.zero_grad(set_to_none=True)
            out = low(*(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs))
            loss = entry.loss_fn(out.float(), target)
            loss.backward()
            losses[-1] += loss.detach() / world
            for grad, param in zip(grads, low.parameters()):
                grad += param.grad
        for param, grad in zip(master.parameters(), grads):
            param.grad = (grad / world).float()
        opt.step()
        with torch.no_grad():
            for param, value in zip(low.parameters(), master.parameters()):
                param.copy_(value)
    return losses, low.state_dict()


def check_low_precision_state(config: dict, got: dict, want: dict) -> None:
    """bfloat16 tolerance. Adam normalizes each element's step to about lr, so where a gradient is at rounding-noise
    level (gpt: the attention key's bias, whose gradient is analytically zero, and what it feeds) two bfloat16 runs
    can step an element by up to lr each in opposite directions: a few elements of the model (at most 0.5%) may be
    off by that much, no element by more."""
    lr = OPTIMIZERS[config["optimizer"]]([torch.zeros(1, requires_grad=True)]).defaults["lr"]
    far, total = 0, 0
    for name, value in want.items():
        diff = (got[name].float() - value.float()).abs()
        assert diff.max().item() <= 2 * lr * config["steps"], (config["zoo"], name, diff.max().item())
        far += int((~torch.isclose(got[name].float(), value.float(), rtol=2e-2, atol=1e-2)).sum())
        total += value.numel()
    assert far <= 0.005 * total, (config["zoo"], far, total)


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


@pytest.mark.slow
def test_pure_low_precision_stages_equal_data_parallel_and_hold_their_pieces(tmp_path):
    """use_pure_fp16 (bfloat16): every stage trains bit for bit as unsharded data parallel (losses, every parameter,
    evaluation), which is within bfloat16 tolerance of eager use_pure_fp16 (`pure_low_precision_reference`).
    Stage 3 holds bfloat16 pieces, whole when gathered (full_state_dict). Per-rank bytes against the table's
    use_pure_fp16 row: gradients are averaged and kept in bfloat16 (passes/data_parallel/low_precision.py), so the
    totals are exactly the row at stages 2 and 3 (flat pieces) and on average over the ranks at stage 1, where each
    rank is within 10% of it on the gpt (whole parameters: on the mlp the rank owning fc2.weight, 59% of the model,
    is 11% over)."""
    results = spawn(2, "train_sharded", {"configs": PURE_CONFIGS}, tmp_path, deadline_s=400,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    runs = [r.result["runs"] for r in results]
    plain_index = 0
    for i, config in enumerate(PURE_CONFIGS):
        stage = config["strategy"].get("sharding_configs", {}).get("stage", 0)
        if not stage:
            plain_index = i
            plain = [rank[i] for rank in runs]
            losses, want = pure_low_precision_reference(config, 2, plain[0]["initial"])
            mean = [sum(run["losses"][step] for run in plain) / 2 for step in range(config["steps"])]
            torch.testing.assert_close(torch.stack(mean), torch.stack(losses), rtol=2e-2, atol=1e-2)
            check_low_precision_state(config, plain[0]["state"], want)  # eager bfloat16, float32 master weights
            continue
        for rank, ours in zip(runs, (rank[i] for rank in runs)):
            base = rank[plain_index]
            assert [float(x) for x in ours["losses"]] == [float(x) for x in base["losses"]], (config, stage)
            assert ours["full_state"].keys() == base["state"].keys()
            for name, value in base["state"].items():  # whole and current
                assert torch.equal(ours["full_state"][name], value), (config["zoo"], stage, name)
            assert torch.equal(ours["eval"], base["eval"]), (config, stage)
            # a bfloat16 forward (gpt: logits up to ~5) beside float32 eager on the same whole parameters
            torch.testing.assert_close(ours["eval"].float(), ours["eager_eval"], rtol=2e-2, atol=5e-2)
            memory = ours["memory"]
            psi, n = memory["parameters"], 2
            row = {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
            assert memory["formula_bytes"] == round(row)
            assert memory["gradient_bytes"] == 2 * psi / (n if stage >= 2 else 1), (stage, memory)
            if stage >= 2:  # flat pieces: exactly the row
                assert memory["total_bytes"] == round(row), (stage, memory)
            else:  # whole parameters: bfloat16 parameters and gradients, and the state of what this rank owns
                assert memory["total_bytes"] == 4 * psi + memory["optimizer_state_bytes"], memory
            if config["zoo"] == "gpt" or stage >= 2:  # (the mlp's stage 1: one matrix is 59% of it, see below)
                assert abs(memory["total_bytes"] - row) <= 0.1 * row, (config["zoo"], stage, memory)
        if stage == 1:  # the ranks' owned shares add up to the whole state: on average exactly the row
            assert sum(rank[i]["memory"]["total_bytes"] for rank in runs) == round(2 * row), config
        if stage == 3:
            held = [rank[i]["held_param_elements"] for rank in runs]
            assert sum(held) == runs[0][i]["memory"]["parameters"] and max(held) < sum(held), held
            assert all("params_split" in rank[i]["report"]["sharding"] for rank in runs)
            assert all(rank[i]["memory"]["gathered_in_flight_bytes"] > 0 for rank in runs)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="CI time: FLEETC_FULL=1")
def test_pure_low_precision_stage_3_checkpoint_resumes_on_two_ranks_and_in_one_process(tmp_path):
    """Stage 3 × use_pure_fp16 written by 2 ranks (each its pieces of the bfloat16 parameters, float32 master
    weights and moments): 2 ranks resume it bit for bit; one process loads the whole state (every piece joined:
    master weights and moments equal the ranks' pieces laid end to end, the bfloat16 parameters the gathered ones)
    and trains the third step on the full batch within bfloat16 tolerance of the ranks."""
    checkpoint = str(tmp_path / "ckpt")
    strategy = dict(PURE_BF16, **sharded(3))
    # loaded before the first step: after it the parameters are bfloat16 and the float32 masters are refused
    results = spawn(2, "checkpoint_round_trip", {"strategy": strategy, "save": checkpoint, "load": checkpoint},
                    tmp_path / "ranks", deadline_s=180, module="fleet.sharding_workers")
    assert_all_ok(results)
    ranks = [result.result for result in results]
    for rank in ranks:
        for name, value in ranks[0]["continued"].items():
            assert torch.equal(rank["resumed"][name], value), name
    torch.manual_seed(5)
    model = ZOO["mlp"].make_model()
    trainer = fleetc.compile(model, make_strategy(PURE_BF16), optimizer=OPTIMIZERS["adam"](model.parameters()),
                             loss_fn=ZOO["mlp"].loss_fn)
    trainer.load_checkpoint(checkpoint)
    for name, value in ranks[0]["saved"].items():
        assert torch.equal(model.state_dict()[name].to(value.dtype), value), name
    named = dict(model.named_parameters())
    for name, param in named.items():
        state = trainer.optimizer.state[param]
        for key in ("master_weight", "exp_avg", "exp_avg_sq"):
            pieces = sorted((rank["saved_pieces"][name][0], rank["saved_state"][name][key]) for rank in ranks
                            if name in rank["saved_pieces"])
            joined = torch.cat([piece.reshape(-1) for _, piece in pieces])
            assert state[key].dtype == torch.float32 and torch.equal(state[key].reshape(-1), joined), (name, key)
    trainer.step(*global_batches("mlp", 3)[2])
    for name, value in ranks[0]["continued"].items():
        torch.testing.assert_close(model.state_dict()[name].float(), value.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="CI time: FLEETC_FULL=1")
def test_pure_low_precision_stage_3_with_whole_parameter_ownership_equals_data_parallel(tmp_path):
    """ClipGradByNorm reads whole gradients, so stage 3 owns whole parameters (ShardedParameters): a rank's module
    holds the parameters it does not own empty, but in bfloat16 too, so the whole-parameter gathers of the two
    ranks agree. Trains bit for bit as use_pure_fp16 data parallel does."""
    configs = [clipped(dict(PURE_BF16, **extra), clip=("norm", 0.05)) for extra in ({}, sharded(3))]
    results = spawn(2, "train_configs", {"configs": configs}, tmp_path, deadline_s=180,
                    module="fleet.optimizer_workers")
    assert_all_ok(results)
    for result in results:
        plain, stage_3 = result.result
        assert "params_split" not in stage_3["stats"]["sharding"]  # whole parameters
        assert stage_3["stats"]["sharding"]["param_gather_buckets"] == 2
        for name, value in plain["state"].items():
            assert value.dtype == torch.bfloat16 and torch.equal(stage_3["state"][name], value), name


MERGED_MESH = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2},
               "hybrid_configs": {"dp_degree": 2, "sharding_degree": 2}}
# unsharded data parallel with gradient merge on 4 ranks, then stage 3 (small parameter buckets) on
# dp_degree=2 × sharding_degree=2 with the same merge: two updates of two merged steps each. The cnn, not the mlp:
# Adam on the mlp over 4 shards has an element whose gradient is rounding noise (float64 eager lands 0.04 away from
# float32 eager there), where unsharded data parallel, summing in another order, is 1.5e-5 from eager.
MERGED_MESH_CONFIGS = [
    {"zoo": "cnn", "optimizer": "adam", "steps": 4, "strategy": {key: MERGED_MESH[key] for key in MERGED_MESH
                                                                  if key != "hybrid_configs"}},
    {"zoo": "cnn", "optimizer": "adam", "steps": 4,
     "strategy": {**MERGED_MESH, **sharded(3, sharding_configs={"stage": 3, "segment_broadcast_MB": 0.01})}}]


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="4 processes: FLEETC_FULL=1")
def test_stage_3_with_gradient_merge_on_data_parallel_replicas_of_sharding_groups(tmp_path):
    """Stage 3 × gradient merge (k=2) on dp_degree=2 × sharding_degree=2: each rank accumulates its own gradients
    whole, once per k steps reduce-scatters them over its sharding group and averages its pieces over its replica.
    Both runs match eager accumulating over the 4 shards (fp32 tolerance; losses and every parameter) and each other;
    replicas (0, 2) and (1, 3) hold the same pieces, which cover the model once per sharding group."""
    results = spawn(4, "train_sharded", {"configs": MERGED_MESH_CONFIGS}, tmp_path, deadline_s=420,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    for i, config in enumerate(MERGED_MESH_CONFIGS):
        check_run(results, i, 4, config, per_shard=True, atol=FP32_ATOL)
    plain, merged = ([r.result["runs"][i] for r in results] for i in range(2))
    for ours, base in zip(merged, plain):
        for name, value in base["state"].items():
            torch.testing.assert_close(ours["state"][name], value, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(ours["eval"], ours["eager_eval"])
    stats = merged[0]["report"]["sharding"]
    assert stats["params_split"] >= 1 and stats["reduce_scatter_buckets"] > 1, stats
    held = [run["held_param_elements"] for run in merged]
    whole = merged[0]["memory"]["parameters"]
    assert held[0] == held[2] and held[1] == held[3] and held[0] + held[1] == whole, held
    assert merged[0]["memory"]["merge_accumulator_bytes"] == 4 * whole
    assert merged[0]["update_block"] is not None and plain[0]["update_block"] is not None
