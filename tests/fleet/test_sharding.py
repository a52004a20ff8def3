"""ZeRO sharding stages 1 and 2 in 2 processes on loopback (gloo) match eager training accumulating over the same
shards of the batch: losses, every parameter on every rank, several steps.

The reference runs each shard's forward and backward on its own (as the ranks do), not one backward on the full
batch: Adam divides by the root of the squared gradient, and where a gradient is analytically zero (the attention
key's bias: softmax ignores a shift) a full-batch backward's different rounding would become an lr-sized update.
Even so the compiled backward rounds differently from eager there, by up to about 4e-6 after 3 AdamW steps, so
parameters are compared at torch's fp32 tolerance, as the single-process differential harness compares them.
"""
from __future__ import annotations

import os
import pathlib

import pytest
import torch
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import assert_all_ok, spawn
from fleet.test_data_parallel import check_run
from fleet.workers import global_batches

FP32_ATOL = 1e-5  # torch.testing.assert_close's default for float32


def sharded(stage: int, **fields) -> dict:
    return {"sharding": True, "sharding_configs": {"stage": stage}, **fields}


# Dropout off in every gpt run: each rank's masks come from its own RNG stream (as in data parallel).
TWO_RANK_CONFIGS = [
    {"zoo": "gpt", "optimizer": "adam", "steps": 3, "dropout_off": True, "strategy": sharded(1)},
    {"zoo": "gpt", "optimizer": "adam", "steps": 3, "dropout_off": True,
     "strategy": sharded(2, fuse_grad_size_in_TFLOPS=8)},
    {"zoo": "cnn", "optimizer": "momentum", "steps": 3, "strategy": sharded(2)},
    {"zoo": "cnn", "optimizer": "momentum", "steps": 3, "strategy": sharded(1)},  # stage 1's 8Ψ + 4Ψ/N row
    # one gradient per bucket and tiny gather buckets: many collectives, ranks owning nothing in some buckets
    {"zoo": "cnn", "optimizer": "adamw", "steps": 3,
     "strategy": sharded(1, fuse_all_reduce_ops=False, sharding_configs={"stage": 1, "segment_broadcast_MB": 0.001})},
    # stage 2 on flat buckets of one gradient each: every parameter of more than one element is split between ranks
    {"zoo": "cnn", "optimizer": "adamw", "steps": 3, "strategy": sharded(2, fuse_all_reduce_ops=False)},
]

# gpt × AdamW is left out: the attention key's bias has an analytically zero gradient (softmax ignores a shift),
# and AdamW (no L2 term in the gradient) turns its rounding noise into lr-sized updates, so plain data parallel
# differs from eager there by ~3e-3 too; sharded runs of it equal plain data parallel bit for bit
# (test_gpt_adamw_equals_plain_data_parallel).
FULL_CONFIGS = [
    {"zoo": zoo, "optimizer": optimizer, "steps": 3, "dropout_off": True, "strategy": sharded(stage)}
    for zoo in ("gpt", "cnn") for optimizer in ("momentum", "adam", "adamw") for stage in (1, 2)
    if (zoo, optimizer) != ("gpt", "adamw")]


def check_sharding(results, configs: list[dict], world: int) -> None:
    assert_all_ok(results)
    for i, config in enumerate(configs):
        check_run(results, i, world, config, per_shard=True, atol=FP32_ATOL)
        runs = [r.result["runs"][i] for r in results]
        owned = [run["report"]["sharding"]["owned_params"] for run in runs]
        stage = config["strategy"]["sharding_configs"]["stage"]
        if stage >= 2 and "params_split" in runs[0]["report"]["sharding"]:  # flat buckets: pieces of parameters
            assert sum(owned) > runs[0]["params"], owned
            if config["strategy"].get("fuse_all_reduce_ops") is False:
                assert all(run["report"]["sharding"]["params_split"] == run["params"] for run in runs)
        else:
            assert sum(owned) == runs[0]["params"], f"every parameter has one owner: {owned} of {runs[0]['params']}"
        # every rank holds only its owners' share of the optimizer state, and all of it is somewhere
        assert all(0 < run["state_elements"] for run in runs)
        kinds = set(runs[0]["op_types"])
        assert ("fleetc.c_sharding_allgather" in kinds) == (stage < 3)
        assert ("fleetc.c_sharding_reduce_scatter_start" in kinds) == (stage >= 2)
        assert ("fleetc.c_allreduce_start" in kinds) == (stage == 1)
        assert ("fleetc.c_sharding_param_gather_start" in kinds) == (stage == 3)
        held = [run["held_param_elements"] for run in runs]
        if stage == 3:  # between steps each parameter lives on its owner only
            assert sum(held) == runs[0]["memory"]["parameters"] and max(held) < runs[0]["memory"]["parameters"], held
        else:
            assert all(h == runs[0]["memory"]["parameters"] for h in held), held
        for run in runs:
            assert run["guard_failures"] == [None, None]
            torch.testing.assert_close(run["eval"], run["eager_eval"])
            assert list(run["full_state"]) == run["model_keys"]  # keyed like model.state_dict()
            # report() lists sharding as applied, and nothing of it as not applied
            assert "sharding" in run["applied"] and not any("shard" in name for name in run["skipped"]), run["skipped"]
            assert all(torch.equal(run["full_state"][k], v) for k, v in run["state"].items())
        for run in runs:  # parameter + gradient + optimizer-state bytes of each rank, beside the ZeRO formula
            if config.get("unbalanced"):
                continue
            memory = run["memory"]
            assert abs(memory["total_bytes"] - memory["formula_bytes"]) <= 0.1 * memory["formula_bytes"], memory


@pytest.mark.slow
def test_stages_1_and_2_on_two_ranks_match_eager_training(tmp_path):
    results = spawn(2, "train_sharded", {"configs": TWO_RANK_CONFIGS}, tmp_path, deadline_s=300,
                    module="fleet.sharding_workers")
    check_sharding(results, TWO_RANK_CONFIGS, 2)


# Stage 3: parameters live on their owners; each bucket is gathered before its first use in the forward and again
# in the backward (tiny gather buckets on gpt: many buckets, prefetched one ahead).
STAGE_3_CONFIGS = [
    # flat parameter buckets: fc2.weight alone is 59% of the mlp and is cut between the ranks (12Ψ/N each)
    {"zoo": "mlp", "optimizer": "momentum", "steps": 3, "strategy": sharded(3)},
    {"zoo": "gpt", "optimizer": "adam", "steps": 3, "dropout_off": True,
     "strategy": sharded(3, sharding_configs={"stage": 3, "segment_broadcast_MB": 0.01})},
]


@pytest.mark.slow
def test_stage_3_on_two_ranks_matches_eager_training(tmp_path):
    results = spawn(2, "train_sharded", {"configs": STAGE_3_CONFIGS}, tmp_path, deadline_s=240,
                    module="fleet.sharding_workers")
    check_sharding(results, STAGE_3_CONFIGS, 2)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="the full zoo × optimizer × stage matrix: FLEETC_FULL=1")
def test_full_matrix_on_two_ranks(tmp_path):
    results = spawn(2, "train_sharded", {"configs": FULL_CONFIGS}, tmp_path, deadline_s=600,
                    module="fleet.sharding_workers")
    check_sharding(results, FULL_CONFIGS, 2)


# The same zoo × optimizer matrix on 4 ranks (each rank one sample of the batch of 4), one spawn per stage. gpt ×
# AdamW is checked against plain data parallel on the same 4 ranks instead of eager (see above).
FOUR_RANK_CONFIGS = {stage: [{"zoo": zoo, "optimizer": optimizer, "steps": 3, "dropout_off": True,
                              "strategy": sharded(stage)}
                             for zoo in ("gpt", "cnn") for optimizer in ("momentum", "adam", "adamw")
                             if (zoo, optimizer) != ("gpt", "adamw")]
                     for stage in (1, 2, 3)}
GPT_ADAMW = {"zoo": "gpt", "optimizer": "adamw", "steps": 3, "dropout_off": True}


def check_beside_plain_adamw(run: dict, plain: dict) -> None:
    """gpt × AdamW sharded beside plain data parallel on 4 ranks. Stage 3 regroups the gradient buckets by parameter
    bucket, so gloo sums 4 ranks' values in another order than plain data parallel's allreduce: every parameter
    equal at fp32 tolerance, except the attention key's bias, whose gradient is analytically zero (softmax ignores a
    shift), so AdamW turns the rounding noise into steps of up to lr each (test_gpt_adamw_equals_plain_data_parallel:
    bit for bit on 2 ranks, where a sum of two does not depend on the order)."""
    lr = OPTIMIZERS["adamw"]([torch.zeros(1, requires_grad=True)]).defaults["lr"]
    assert run["state"].keys() == plain["state"].keys()
    for name, want in plain["state"].items():
        got = run["state"][name]
        if name.endswith("attn.qkv.bias"):
            third = want.numel() // 3
            assert (got[third:2 * third] - want[third:2 * third]).abs().max() <= 2 * lr * GPT_ADAMW["steps"], name
            got, want = torch.cat([got[:third], got[2 * third:]]), torch.cat([want[:third], want[2 * third:]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=FP32_ATOL, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(run["initial"][k], v) for k, v in run["state"].items())


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="the zoo × optimizer matrix on 4 ranks: FLEETC_FULL=1")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_matrix_on_four_ranks(tmp_path, stage):
    configs = FOUR_RANK_CONFIGS[stage]
    adamw = [dict(GPT_ADAMW, strategy={}), dict(GPT_ADAMW, strategy=sharded(stage))]
    results = spawn(4, "train_sharded", {"configs": configs + adamw}, tmp_path, deadline_s=900,
                    module="fleet.sharding_workers")
    check_sharding(results, configs, 4)
    for result in results:
        plain, run = result.result["runs"][len(configs):]
        assert run["report"]["sharding"]["owned_params"] > 0
        check_beside_plain_adamw(run, plain)


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="FLEETC_FULL=1")
def test_gpt_adamw_equals_plain_data_parallel(tmp_path):
    configs = [{"zoo": "gpt", "optimizer": "adamw", "steps": 3, "dropout_off": True, "strategy": strategy}
               for strategy in ({}, sharded(1), sharded(2), sharded(3))]
    results = spawn(2, "train_sharded", {"configs": configs}, tmp_path, deadline_s=300,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    for result in results:
        plain, *stages = result.result["runs"]
        for run in stages:
            assert all(torch.equal(run["state"][k], v) for k, v in plain["state"].items())


def resume_in_one_process(checkpoint: str) -> dict:
    """A single process (no sharding, no ranks) loads the checkpoint and trains the third step on the full batch."""
    torch.manual_seed(5)
    model = ZOO["mlp"].make_model()
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS["adam"](model.parameters()), loss_fn=ZOO["mlp"].loss_fn)
    trainer.load_checkpoint(checkpoint)
    trainer.step(*global_batches("mlp", 3)[2])
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stage, step_before_load", [(2, False), (3, True), (1, True)])
def test_sharded_checkpoint_resumes_on_two_ranks_and_in_one_process(tmp_path, stage, step_before_load):
    """Written by 2 ranks under stage 2 or 3 (parameters gathered for the write), read back by 2 ranks (each keeps
    its own share) and by one process. A rank loading before its first step does not know its share yet and reads
    every optimizer shard; after a step it reads only the files holding its share: under stage 1 the one it wrote,
    under stage 3 on flat buckets both files here."""
    checkpoint = str(tmp_path / "ckpt")
    results = spawn(2, "checkpoint_round_trip", {"strategy": sharded(stage), "save": checkpoint, "load": checkpoint,
                                                 "step_before_load": step_before_load},
                    tmp_path / "ranks", deadline_s=120, module="fleet.sharding_workers")
    assert_all_ok(results)
    version = pathlib.Path(checkpoint, (pathlib.Path(checkpoint) / "LATEST").read_text().strip())
    shards = sorted(p.name for p in version.glob("optimizer.shard*.pt"))
    assert shards == ["optimizer.shard00000.pt", "optimizer.shard00001.pt"]  # each rank wrote its own
    assert torch.load(version / "optimizer.pt")["state"] == {}
    for rank, result in enumerate(results):  # stage 3 on flat buckets: fc2.weight is cut between the two ranks,
        # so each rank's share is in both files; stage 1 owns whole parameters, each in one file
        assert result.result["shards_read"] == ([f"optimizer.shard{rank:05d}.pt"] if stage == 1 else shards)
    continued = results[0].result["continued"]
    for result in results:
        for name, value in continued.items():
            assert torch.equal(result.result["resumed"][name], value), name
    # each rank holds its share of Adam's state after loading all of it (mlp: 6922 parameters, 2 moments each)
    shares = [result.result["state_elements"] for result in results]
    assert sum(shares) == 2 * 6922 and min(shares) > 0
    single = resume_in_one_process(checkpoint)
    for name, value in continued.items():
        torch.testing.assert_close(single[name], value, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="4 processes: FLEETC_FULL=1")
def test_checkpoint_of_four_ranks_resumes_on_two(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    written = spawn(4, "checkpoint_round_trip", {"strategy": sharded(2), "save": checkpoint}, tmp_path / "four",
                    deadline_s=240, module="fleet.sharding_workers")
    assert_all_ok(written)
    # 4 ranks and 2 ranks split the batch differently: compare both to one process resuming on the full batch
    single = resume_in_one_process(checkpoint)
    resumed = spawn(2, "checkpoint_round_trip", {"strategy": sharded(1), "load": checkpoint}, tmp_path / "two",
                    deadline_s=120, module="fleet.sharding_workers")
    assert_all_ok(resumed)
    for name, value in single.items():
        torch.testing.assert_close(resumed[0].result["resumed"][name], value, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(written[0].result["continued"][name], value, msg=lambda m: f"{name}: {m}")


def stage_2_beside_plain_data_parallel(strategy: dict, zoo: str = "mlp", steps: int = 3, stage: int = 2,
                                       **sharding_configs) -> list[dict]:
    return [{"zoo": zoo, "optimizer": "adam", "steps": steps, "dropout_off": True, "strategy": dict(strategy, **extra)}
            for extra in ({}, sharded(stage, sharding_configs={"stage": stage, **sharding_configs}))]


MERGED = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}
# use_pure_fp16: bfloat16 parameters, float32 master weights in the (sharded) optimizer state
PURE_BF16 = {"amp": True, "amp_configs": {"use_pure_fp16": True, "use_fp16_guard": False, "dtype": "bfloat16"}}

# Stage 2 must train exactly as unsharded data parallel does under each composed strategy (which itself matches
# eager training in test_data_parallel.py): AMP (each rank checks its pieces of the flat buckets, found_inf
# max-allreduced), gradient merge (whole accumulators reduce-scattered flat once per k steps), recompute,
# use_pure_fp16 and fp16_allreduce (bfloat16 pieces reduce-scattered), and AMP under gradient merge (each rank
# checks its pieces of the merged gradients).
COMPOSED = [
    *stage_2_beside_plain_data_parallel({"amp": True}),
    *stage_2_beside_plain_data_parallel({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, steps=4),
    *stage_2_beside_plain_data_parallel({"recompute": True, "recompute_configs": {"checkpoints": ["layers.0"]}},
                                        zoo="gpt"),
    *stage_2_beside_plain_data_parallel(PURE_BF16),
    *stage_2_beside_plain_data_parallel({"fp16_allreduce": True}),
    *stage_2_beside_plain_data_parallel({"amp": True, **MERGED}, steps=4),
]


# Stage 3 as well: the gathered parameters are exact copies, so again bit for bit. Under gradient merge, small
# parameter buckets (3 on the mlp, fc2.weight alone in one): the accumulators are reduce-scattered by those buckets.
COMPOSED_3 = [
    *stage_2_beside_plain_data_parallel({"amp": True}, stage=3),
    *stage_2_beside_plain_data_parallel({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, steps=4,
                                        stage=3, segment_broadcast_MB=0.01),
    *stage_2_beside_plain_data_parallel({"recompute": True, "recompute_configs": {"checkpoints": ["layers.0"]}},
                                        zoo="gpt", stage=3),
    *stage_2_beside_plain_data_parallel({"amp": True, **MERGED}, steps=4, stage=3),
]


@pytest.mark.slow
@pytest.mark.parametrize("composed", [COMPOSED, COMPOSED_3], ids=["stage_2", "stage_3"])
def test_stages_2_and_3_compose_with_amp_gradient_merge_and_recompute(tmp_path, composed):
    results = spawn(2, "train_sharded", {"configs": composed}, tmp_path, deadline_s=240,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    for result in results:
        runs = result.result["runs"]
        for plain, sharded_run, config in zip(runs[::2], runs[1::2], composed[1::2]):
            for name, value in plain["state"].items():
                assert torch.equal(sharded_run["state"][name], value), (config["strategy"], name)
            assert any(not torch.equal(plain["initial"][k], v) for k, v in plain["state"].items())
        amp, merged, amp_merged = runs[1], runs[3], runs[-1]
        assert amp["report"]["sharding"]["found_inf_allreduces"] == 1
        # AMP under gradient merge: each rank checks its pieces of the merged gradients, found_inf max-allreduced
        assert amp_merged["report"]["sharding"]["found_inf_allreduces"] == 1
        # stages 2 and 3 under AMP and gradient merge on flat buckets: fc2.weight is cut in two
        for run in (amp, merged, amp_merged):
            assert run["report"]["sharding"]["params_split"] >= 1
        # once per k steps, in the update block: stage 2 by gradient bucket, stage 3 by parameter bucket
        assert merged["report"]["sharding"]["reduce_scatter_buckets"] == (1 if composed is COMPOSED else 3)
        for run in (amp, merged, amp_merged):  # parameter + gradient + state bytes beside the formula's fp32 row
            memory = run["memory"]
            assert abs(memory["total_bytes"] - memory["formula_bytes"]) <= 0.1 * memory["formula_bytes"], memory
        # the accumulators stay whole on every rank (each sums its own local gradients), on top of the formula
        assert merged["memory"]["merge_accumulator_bytes"] == 4 * merged["memory"]["parameters"]
        assert merged["report"]["sharding"]["owned_params"] > 0
        if composed is COMPOSED:  # the master weights' updates read pieces of the averaged gradients too
            assert runs[7]["report"]["sharding"]["params_split"] >= 1
            # fp16_allreduce: float32 parameters, bfloat16 gradient pieces reduce-scattered and kept
            assert runs[9]["report"]["sharding"]["params_split"] >= 1
            assert runs[9]["memory"]["gradient_bytes"] == runs[9]["memory"]["parameters"]  # 2 bytes, on 2 ranks


@pytest.mark.slow
def test_a_dead_rank_in_the_reduce_scatter_fails_the_survivor_within_the_timeout(tmp_path):
    survivor, dead = spawn(2, "dead_rank_in_reduce_scatter", {"strategy": sharded(2)}, tmp_path, deadline_s=60,
                           collective_timeout_s=5.0, module="fleet.sharding_workers")
    assert dead.returncode == 3 and survivor.returncode == 0, survivor.output[-3000:]
    error = survivor.result["error"]
    assert "sharding gradient reduce-scatter 'bucket0'" in error and "rank(s) [1] did not reach it" in error, error
    assert survivor.result["seconds"] < 5.0 + 8.0


@pytest.mark.slow
def test_a_rank_that_owns_no_parameter_trains_as_eager_at_every_stage(tmp_path):
    """One 1-element parameter on 2 ranks: rank 1 owns nothing at any stage, holds no optimizer state, and still
    takes part in every collective; both ranks end with eager's parameter, losses and evaluation."""
    results = spawn(2, "owns_nothing", {}, tmp_path, deadline_s=180, module="fleet.sharding_workers")
    assert_all_ok(results)
    for stage, (first, second) in enumerate(zip(*(r.result["runs"] for r in results)), start=1):
        assert (first["owned"], second["owned"]) == (1, 0), stage
        assert (first["state_elements"], second["state_elements"]) == (2, 0), stage  # Adam's two moments
        for step, want in enumerate(first["eager_losses"]):
            torch.testing.assert_close((first["losses"][step] + second["losses"][step]) / 2, want,
                                       msg=lambda m, stage=stage: f"stage {stage}: {m}")
        for run in (first, second):
            assert run["state"].keys() == run["eager_state"].keys()
            for name, value in run["eager_state"].items():
                torch.testing.assert_close(run["state"][name], value, msg=lambda m, stage=stage: f"stage {stage}: {m}")
            torch.testing.assert_close(run["eval"], run["eager_eval"])


@pytest.mark.slow
def test_a_shard_that_fails_to_write_aborts_the_checkpoint_on_every_rank(tmp_path):
    """The write is atomic across ranks: rank 1's optimizer shard fails, so no rank commits; both get the error
    naming rank 1, LATEST still names the first version, nothing of the failed save is left, and loading gives the
    first save's state."""
    checkpoint = str(tmp_path / "ckpt")
    results = spawn(2, "failed_shard_write", {"strategy": sharded(2), "save": checkpoint}, tmp_path / "ranks",
                    deadline_s=120, module="fleet.sharding_workers")
    assert_all_ok(results)
    for result in results:
        out = result.result
        assert out["error"] and "rank 1 writing optimizer.shard00001.pt" in out["error"], out["error"]
        assert "No space left on device" in out["error"]
        assert out["entries"] == ["LATEST", out["first"]], out["entries"]
        assert out["loaded_version"] == out["first"]
        for name, value in results[0].result["saved"].items():
            assert torch.equal(out["loaded"][name], value), name


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="FLEETC_FULL=1 (the plan check itself: test_faults.py)")
@pytest.mark.parametrize("configs", [
    [sharded(3), sharded(3, sharding_configs={"stage": 3, "segment_broadcast_MB": 0.0001})],
    [sharded(2), sharded(1)]], ids=["segment_size", "stage"])
def test_ranks_that_shard_differently_refuse_before_the_first_collective(tmp_path, configs):
    results = spawn(2, "plan_mismatch", {"configs": configs}, tmp_path, deadline_s=120, collective_timeout_s=10.0,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    for result in results:
        assert "different collectives" in result.result["error"], result.result["error"]
        assert result.result["unchanged"]


# Global-norm clipping where each rank keeps only its gradient shards: the squared norm of the kept gradients is
# summed over the sharding group, so every rank clips by the norm of all of them, as unsharded data parallel does
# (itself checked against eager in test_data_parallel.py); under AMP each rank clips the shards it unscaled. Stages 2
# and 3 split the mlp's one bucket evenly, so a rank's pieces cut fc2.weight and the padding is in no piece.
# Under gradient merge each rank clips its pieces of the merged gradients, reduce-scattered once per k steps.
# Stage 3 (flat parameter buckets) does the same with the pieces of the parameters it holds.
# clip_norm 0.05 clips every step of the mlp.
def clipped(strategy: dict, clip: list | None = ("global_norm", 0.05)) -> dict:
    return {"optimizer": "adam", "steps": 3, "grad_clip": list(clip) if clip else None, "strategy": strategy}


CLIPPED = [clipped({}), clipped(sharded(2)), clipped(sharded(3)), clipped({"amp": True}),
           clipped({**sharded(2), "amp": True}), clipped({}, clip=None), clipped(MERGED),
           clipped({**sharded(2), **MERGED}), clipped({**sharded(3), "amp": True}), clipped({**sharded(3), **MERGED}),
           clipped({"amp": True, **MERGED}), clipped({**sharded(3), "amp": True, **MERGED})]


@pytest.mark.slow
def test_global_norm_clipping_under_stages_2_and_3_equals_data_parallel(tmp_path):
    results = spawn(2, "train_configs", {"configs": CLIPPED}, tmp_path, deadline_s=240,
                    module="fleet.optimizer_workers")
    assert_all_ok(results)
    for result in results:
        (plain, stage_2, stage_3, amp, stage_2_amp, unclipped, merged, stage_2_merged, stage_3_amp, stage_3_merged,
         amp_merged, stage_3_amp_merged) = result.result
        for reference, run in ((plain, stage_2), (plain, stage_3), (amp, stage_2_amp), (merged, stage_2_merged),
                               (amp, stage_3_amp), (merged, stage_3_merged), (amp_merged, stage_3_amp_merged)):
            assert run["stats"]["sharding"]["clip_norm_allreduces"] == 1
            # flat buckets: the norm of the pieces (fc2.weight's cut in two), padding in none of them
            assert run["stats"]["sharding"]["params_split"] >= 1
            for name, value in reference["state"].items():
                torch.testing.assert_close(run["state"][name], value, msg=lambda m, name=name: f"{name}: {m}")
        assert any(not torch.allclose(unclipped["state"][k], v) for k, v in plain["state"].items())


def mesh_configs(stages: tuple[int, ...]) -> list[dict]:
    return [{"zoo": "mlp", "optimizer": "momentum", "steps": 3,
             "strategy": {**sharded(stage), "hybrid_configs": {"dp_degree": 2, "sharding_degree": 2}}}
            for stage in stages]


# CI: stage 3 (shards reduce-scattered in the sharding group, then summed over the replicas; parameters gathered in
# the rank's own sharding group), the only default-CI run of dp × sharding on processes; stages 1 and 2: FLEETC_FULL.
@pytest.mark.slow
@pytest.mark.parametrize("stages", [pytest.param((3,), id="ci"), pytest.param(
    (1, 2), id="full", marks=pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="FLEETC_FULL=1"))])
def test_data_parallel_replicas_of_sharding_groups_on_four_ranks(tmp_path, stages):
    """dp_degree=2 × sharding_degree=2: ranks 0, 1 and ranks 2, 3 are sharding groups, (0, 2) and (1, 3) replicas
    of the same shard. Every stage trains as eager on the whole batch (summed over all 4 ranks' shards)."""
    configs = mesh_configs(stages)
    results = spawn(4, "train_sharded", {"configs": configs}, tmp_path, deadline_s=420,
                    module="fleet.sharding_workers")
    assert_all_ok(results)
    for i, config in enumerate(configs):
        check_run(results, i, 4, config, per_shard=True, atol=FP32_ATOL)
        runs = [r.result["runs"][i] for r in results]
        owned = [run["report"]["sharding"]["owned_params"] for run in runs]
        assert owned[0] == owned[2] and owned[1] == owned[3], owned
        split = "params_split" in runs[0]["report"]["sharding"]  # stage 2 on flat buckets: a parameter may be split
        assert owned[0] + owned[1] > runs[0]["params"] if split else owned[0] + owned[1] == runs[0]["params"], owned
        held = [run["held_param_elements"] for run in runs]
        whole = runs[0]["memory"]["parameters"]
        if config["strategy"]["sharding_configs"]["stage"] == 3:
            assert held[0] == held[2] and held[1] == held[3] and held[0] + held[1] == whole, held
        for run in runs:
            torch.testing.assert_close(run["eval"], run["eager_eval"])
            memory = run["memory"]  # the formula over the sharding group (N = 2), not the world
            assert memory["degree"] == 2, memory
            assert abs(memory["total_bytes"] - memory["formula_bytes"]) <= 0.1 * memory["formula_bytes"], memory
