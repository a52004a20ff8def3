"""Sharding as a demanding user combines it, on gloo ranks on loopback: stages 1, 2 and 3 each with

- recompute and AMP bf16 together (the zoo GPT), bit for bit as unsharded data parallel under the same strategy;
- gradient merge (k=2) and global-norm clipping together;
- SGD with momentum and AdamW, each with weight decay and two parameter groups of different lr and decay;
- `fleetc.Strategy({"sharding": {...}})` against the DistributedStrategy path;
- evaluation after training and `trainer.full_state_dict()` on every rank;
- dp_degree=2 × sharding_degree=2 on 4 ranks with clipping and two parameter groups (`FLEETC_FULL=1`).

fp32 configs are also checked against eager PyTorch summing every shard's own forward and backward (as the ranks
do), at fp32 tolerance: test_sharding.py's reference, with parameter groups, clipping and gradient merge.
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from zoo import ZOO

import fleetc
from fleet.sharding_review_workers import make_optimizer, user_batches
from fleet.spawn import assert_all_ok, spawn
from fleet.test_sharding import FP32_ATOL, sharded
from fleet.workers import make_model, make_strategy
from fleetc.cli import main
from fleetc.runtime.checkpoint import STATE_KEY

FULL = pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="the rest of the review matrix: FLEETC_FULL=1")
MERGE_CLIP = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
RECOMPUTE_BF16 = {"recompute": True, "recompute_configs": {"checkpoints": ["layers.0"]}, "amp": True,
                  "amp_configs": {"dtype": "bfloat16"}}


def pair(config: dict, stage: int, **sharded_fields) -> list[dict]:
    """`config` unsharded, then under `stage` (and `sharded_fields`); both with the eager reference when fp32."""
    base = dict(config, eager=not config["strategy"].get("amp"))
    return [base, {**base, "strategy": {**config["strategy"], **sharded(stage, **sharded_fields)}}]


def merged_clipped(stage: int) -> list[dict]:
    return pair({"zoo": "mlp", "optimizer": "adam", "steps": 4, "grad_clip": ["global_norm", 0.05],
                 "strategy": MERGE_CLIP}, stage)


def grouped(optimizer: str, stage: int) -> list[dict]:
    return pair({"zoo": "mlp", "optimizer": optimizer, "groups": True, "steps": 3, "strategy": {}}, stage)


def recomputed_bf16(stage: int) -> list[dict]:
    return pair({"zoo": "gpt", "optimizer": "adam", "steps": 2, "dropout_off": True, "strategy": RECOMPUTE_BF16},
                stage)


def labelled(label: str):
    """An assert_close message naming the config and value."""
    return lambda message: f"{label}: {message}"


def check_pairs(results, configs: list[dict]) -> None:
    """Each sharded run beside the unsharded run before it: the same losses and parameters (bit for bit but under
    global-norm clipping, whose norm sums the pieces in another order), equal on every rank; an eval after training
    equals eager's on the gathered parameters (under AMP: unsharded data parallel's); fp32 runs also match the eager reference."""
    assert_all_ok(results)
    for i in range(0, len(configs), 2):
        config = configs[i + 1]
        exact = not config.get("grad_clip")
        plain = [r.result["runs"][i] for r in results]
        runs = [r.result["runs"][i + 1] for r in results]
        where = f"config {i + 1}: {config}"
        assert "sharding" in runs[0]["stats"], (where, runs[0]["skipped"])
        for run, reference in zip(runs, plain):
            assert run["state"].keys() == reference["state"].keys()
            for name, value in reference["state"].items():
                if exact:
                    assert torch.equal(run["state"][name], value), (where, name, (run["state"][name] - value).abs().max())
                else:
                    torch.testing.assert_close(run["state"][name], value, msg=labelled(f"{where} {name}"))
            for got, want in zip(run["losses"], reference["losses"]):
                assert torch.equal(got, want) if exact else torch.allclose(got, want), (where, got, want)
            assert len(run["evals"]) == len(reference["evals"])
            assert all(torch.equal(a, b) for a, b in zip(run["evals"], reference["evals"])), where
            if config["strategy"].get("amp"):  # evaluation in bf16: as unsharded data parallel evaluates
                assert torch.equal(run["eval"], reference["eval"]), where
            else:
                torch.testing.assert_close(run["eval"], run["eager_eval"], msg=labelled(f"{where} eval"))
            assert all(torch.equal(run["state"][k], v) for k, v in runs[0]["state"].items()), where
            assert run["param_groups"] == reference["param_groups"], where
            if config["strategy"]["sharding_configs"]["stage"] < 3:  # the user's module itself: whole and current
                assert all(torch.equal(run["module_state"][k], v) for k, v in run["state"].items()), where
        assert any(not torch.equal(runs[0]["state"][k], v) for k, v in runs[0]["initial"].items()), where
        if config.get("eager"):
            eager = runs[0]["eager"]
            world = len(results)
            for step, want in enumerate(eager["losses"]):
                got = sum(run["losses"][step] for run in runs) / world
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=labelled(f"{where} loss {step}"))
            for name, want in eager["state"].items():
                torch.testing.assert_close(runs[0]["state"][name], want, rtol=1e-5, atol=FP32_ATOL,
                                           msg=labelled(f"{where} {name}"))


# CI: one spawn, the cheap mlp compositions at every stage.
CI_CONFIGS = [*merged_clipped(2), *grouped("adamw", 3), *grouped("momentum", 1)]
# The newer API beside the DistributedStrategy path (sharding_degree left at its default: the world size).
STYLES = [{"zoo": "mlp", "optimizer": "adam", "steps": 2, "strategy": sharded(stage), **new_style}
          for stage in (2, 3) for new_style in ({}, {"new_style": {"enable": True, "stage": stage}})]
# A degree the user set that does not divide the 2 ranks, in each place it can be set.
REFUSED = [{"strategy": sharded(2, sharding_configs={"stage": 2, "sharding_degree": 3})},
           {"strategy": sharded(1, hybrid_configs={"sharding_degree": 3})},
           {"strategy": {}, "new_style": {"enable": True, "stage": 2, "degree": 3}}]


@pytest.mark.slow
def test_sharded_compositions_equal_data_parallel_and_eager(tmp_path):
    results = spawn(2, "train_configs", {"configs": CI_CONFIGS + STYLES, "refused": REFUSED}, tmp_path,
                    deadline_s=240, module="fleet.sharding_review_workers")
    check_pairs(results, CI_CONFIGS)
    for result in results:
        runs = result.result["runs"][len(CI_CONFIGS):]
        for old, new in (runs[0:2], runs[2:4]):  # fleetc.Strategy trains the same Program as DistributedStrategy
            assert new["op_types"] == old["op_types"] and new["stats"] == old["stats"]
            assert all(torch.equal(new["state"][k], v) for k, v in old["state"].items())
            for run in (old, new):  # the default degree (8) means the world size, and report() says so
                assert any("sharding_configs.sharding_degree is not set (Paddle's default is 8): sharding across "
                           "the 2 rank(s)" in line for line in run["decisions"]), run["decisions"]
        own, hybrid, new_style = result.result["refused"]
        assert own == ("sharding_configs.sharding_degree is 3, which does not divide the world size 2 "
                       "(fleetc.Strategy: sharding.degree)"), own
        assert hybrid == "hybrid_configs.sharding_degree is 3, which does not divide the world size 2", hybrid
        assert new_style == own, new_style  # named in the newer style too
    # the pre-launch estimate of stage 3's parameters in flight is what the trainer measured on these ranks
    measured = results[0].result["runs"][3]["memory"]
    assert measured["stage"] == 3 and measured["gathered_in_flight_bytes"] > 0
    estimated = in_flight_column(shard_plan(tmp_path, 2))
    assert estimated == [pytest.approx(measured["gathered_in_flight_bytes"] / 2**20, abs=1e-3)] * 2, estimated


def shard_plan(tmp_path, world: int) -> list[str]:
    """`fleetc shard-plan` of the zoo mlp (SGD) under flat stage 3 for `world` ranks, in this process."""
    path = tmp_path / "stage3.json"
    path.write_text(json.dumps({"sharding": True, "sharding_configs": {"stage": 3}}))
    capture = tmp_path / "plan.txt"
    with open(capture, "w") as out, contextlib.redirect_stdout(out):
        assert main(["shard-plan", "cli_factories:mlp", "--world-size", str(world), "--strategy", str(path)]) == 0
    return capture.read_text().splitlines()


def in_flight_column(lines: list[str]) -> list[float]:
    header = lines[1].split()
    assert header[-3:] == ["in", "flight", "MB"], header
    return [float(line.split()[-1]) for line in lines if line.split()[0].isdigit()]


def test_shard_plan_for_64_ranks_at_stage_3_prints_each_rank_and_what_is_gathered_in_flight(tmp_path):
    """Flat stage 3 on 64 ranks this machine cannot run: each rank holds 1/64 of the parameters and of the SGD
    gradients (8Ψ/N up to the padding of fewer than N elements) and gathers the whole padded bucket in flight,
    twice (the forward's copy and the backward's prefetched one)."""
    lines = shard_plan(tmp_path, 64)
    assert lines[0].startswith("process mesh dp=1 × pp=1 × sharding=64 × mp=1 (64 ranks); sharding stage 3")
    rows = [line.split() for line in lines if line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(64))
    psi = sum(p.numel() for p in ZOO["mlp"].make_model().parameters())
    segment = -(-psi // 64)
    for row in rows:
        assert float(row[5]) == pytest.approx(8 * segment / 2**20, abs=1e-3), row  # parameters + gradients
    assert in_flight_column(lines) == [round(2 * 4 * segment * 64 / 2**20, 3)] * 64
    assert any(line.startswith("stage 3 also gathers up to") for line in lines)  # the measured ranks' notes follow


# A user's loop: an LR scheduler stepped after each step, an evaluation call between steps, and a last smaller
# batch (captured again), with two parameter groups.
USER_LOOP = [config for stage in (1, 2, 3) for config in pair(
    {"zoo": "mlp", "optimizer": "adam", "groups": True, "steps": 3, "scheduler": True, "eval_between": True,
     "ragged": True, "strategy": {}}, stage)]
# A frozen layer (requires_grad off, not in the optimizer) beside Nesterov momentum and AMSGrad.
FROZEN = [config for optimizer in ("nesterov", "amsgrad") for stage in (1, 2, 3) for config in pair(
    {"zoo": "mlp", "optimizer": optimizer, "freeze": ["fc1.weight", "fc1.bias"], "steps": 3, "strategy": {}}, stage)]
# AMP float16 with dynamic loss scaling (a scale that starts high and halves on each overflow).
FP16 = {"amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 2.0**16, "decr_every_n_nan_or_inf": 1,
                                     "decr_ratio": 0.5, "incr_every_n_steps": 1}}
FP16_CONFIGS = [config for stage in (1, 2, 3)
                for config in pair({"zoo": "mlp", "optimizer": "adam", "steps": 6, "strategy": FP16}, stage)]
# ClipGradByValue with one gradient per bucket, ClipGradByNorm under gradient merge (against data parallel only:
# the eager reference clips by the global norm).
OTHER_CLIPS = [dict(config, eager=False) for stage in (2, 3) for config in [
    *pair({"zoo": "mlp", "optimizer": "momentum", "groups": True, "steps": 3, "grad_clip": ["value", 0.01],
           "strategy": {"fuse_all_reduce_ops": False}}, stage),
    *pair({"zoo": "mlp", "optimizer": "adamw", "groups": True, "steps": 4, "grad_clip": ["norm", 0.05],
           "strategy": MERGE_CLIP}, stage)]]
MERGE_CLIP_CONFIGS = [config for stage in (1, 2, 3) for config in merged_clipped(stage)]
GROUP_CONFIGS = [config for optimizer in ("momentum", "adamw") for stage in (1, 2, 3)
                 for config in grouped(optimizer, stage)]
RECOMPUTE_CONFIGS = [config for stage in (1, 2, 3) for config in recomputed_bf16(stage)]


@FULL
@pytest.mark.parametrize("configs", [MERGE_CLIP_CONFIGS, GROUP_CONFIGS, RECOMPUTE_CONFIGS, USER_LOOP, FROZEN,
                                     FP16_CONFIGS, OTHER_CLIPS],
                         ids=["merge_clip", "param_groups", "recompute_bf16", "user_loop", "frozen", "amp_fp16",
                              "other_clips"])
def test_full_review_matrix(tmp_path, configs):
    results = spawn(2, "train_configs", {"configs": configs}, tmp_path, deadline_s=600,
                    module="fleet.sharding_review_workers")
    check_pairs(results, configs)


MESH_CONFIGS = [config for stage in (1, 2, 3) for config in pair(
    {"zoo": "mlp", "optimizer": "adamw", "groups": True, "steps": 3, "grad_clip": ["global_norm", 0.05],
     "strategy": {}}, stage, hybrid_configs={"dp_degree": 2, "sharding_degree": 2})]


@FULL
def test_dp_by_sharding_on_four_ranks_with_clipping_and_two_param_groups(tmp_path):
    """dp_degree=2 × sharding_degree=2: the clip norm is summed over the sharding group only (replicas hold the
    same averaged pieces), so every stage clips as unsharded data parallel over 4 ranks does, and as eager."""
    results = spawn(4, "train_configs", {"configs": MESH_CONFIGS}, tmp_path, deadline_s=600,
                    module="fleet.sharding_review_workers")
    check_pairs(results, MESH_CONFIGS)


# Saved mid gradient-merge period (k=2, after 3 steps: each rank's own gradients of step 3 in its accumulators) and
# resumed by a fresh trainer on the same ranks: the uninterrupted run (up to rounding: the checkpoint holds the
# accumulators' average over the ranks), without sharding and at every stage. `trainer.state_dict()` holds the same
# average on every rank, and without sharding the first rank's model, optimizer and fleetc state_dicts resume the
# run too; so does the eager loop's `opt.state_dict()` under eager gradient merge.
def mid_period(stages: tuple[int, ...]) -> list[dict]:
    return [{"zoo": "mlp", "optimizer": "adam", "groups": True, "steps": 4, "save_after": 3,
             "strategy": {**MERGE_CLIP, **(sharded(stage) if stage else {})}} for stage in stages]


def close_states(resumed: dict, continued: dict, where) -> list:
    """The names whose resumed value is not the uninterrupted run's up to rounding."""
    return [(where, name) for name, value in continued.items()
            if not torch.allclose(resumed[name], value, rtol=1.3e-6, atol=1e-5)]


def check_resumed(results, configs: list[dict]) -> None:
    assert_all_ok(results)
    for result in results:
        bad = []
        for config, run in zip(configs, result.result):
            where = config["strategy"].get("sharding_configs")
            assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["continued"])), (where, run)
            bad += close_states(run["resumed_state"], run["continued_state"], where)
            if "from_state_dicts" in run:
                assert all(torch.equal(a, b) for a, b in zip(run["from_state_dicts"], run["continued"])), where
                bad += close_states(run["from_state_dicts_state"], run["continued_state"], (where, "state_dicts"))
        assert not bad, bad
    for i, config in enumerate(configs):  # each rank's fleetc state_dict holds the averaged accumulators
        first, second = (r.result[i]["fleetc_state"][STATE_KEY] for r in results)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), config


@pytest.mark.slow
@pytest.mark.parametrize("stages", [pytest.param((0, 2), id="ci"), pytest.param((1, 3), id="full", marks=FULL)])
def test_a_checkpoint_mid_gradient_merge_period_resumes_as_the_uninterrupted_run(tmp_path, stages):
    configs = mid_period(stages)
    eager = mid_period((0,))[0] if 0 in stages else None
    results = spawn(2, "resume_mid_period", {"configs": configs, "dir": str(tmp_path / "ckpt"), "eager": eager},
                    tmp_path, deadline_s=300, module="fleet.sharding_review_workers")
    check_resumed(results, configs)
    if eager is not None:
        first, second = (r.result[-1] for r in results)
        assert first["merge_state"]["accumulators"].keys() == second["merge_state"]["accumulators"].keys()
        assert all(torch.equal(a, second["merge_state"]["accumulators"][i])
                   for i, a in first["merge_state"]["accumulators"].items()), "eager accumulators not averaged"
        for run in (first, second):
            assert not close_states(run["resumed_state"], run["continued_state"], "eager")
    for i, config in enumerate(configs):  # and in one process, on the whole batch
        state = resumed_in_one_process(config, str(tmp_path / "ckpt" / f"ckpt{i}"))
        for name, value in results[0].result[i]["continued_state"].items():
            torch.testing.assert_close(state[name], value, msg=labelled(f"one process, {config['strategy']} {name}"))


def resumed_in_one_process(config: dict, checkpoint: str) -> dict:
    """A plain single-process trainer (gradient merge, no ranks) loads the checkpoint and trains the rest."""
    model = make_model(config)
    strategy = make_strategy({k: v for k, v in config["strategy"].items() if not k.startswith("sharding")})
    trainer = fleetc.compile(model, strategy, optimizer=make_optimizer(model, config), loss_fn=ZOO["mlp"].loss_fn)
    trainer.load_checkpoint(checkpoint)
    for batch in user_batches(config)[config["save_after"]:]:
        trainer.step(*batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
