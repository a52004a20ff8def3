"""Per-stage pipeline checkpoints on 2 processes over gloo (zoo GPT: tied embeddings, Adam; gradient merge k_steps=2):
each stage writes its own part into one commit, the job resumes from them bit for bit mid gradient-merge period,
the tied embedding is stored once, and the checkpoint loads into a single process."""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from helpers.pipeline import SCALING_STATE, STAGED, fleet_reference
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import spawn
from fleetc.comm.mesh import pipeline_layout
from fleetc.fleet.trainer import DataParallelTrainer
from fleetc.runtime import checkpoint_commit
from fleetc.runtime.checkpoint import load_checkpoint
from fleetc.strategy import resolve_conflicts, resolve_strategy

pytestmark = pytest.mark.slow  # CI still runs them

ARGS = {"model": "gpt", "mode": "1F1B", "stages": 2, "microbatches": 2, "batch": 4, "k_steps": 2, "steps": 5}


def _run(worker: str, args: dict, out) -> list:
    results = spawn(2, worker, args, out, deadline_s=180, module="fleet.pipeline_checkpoint_workers")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    return results


def _single_process_trainer(strategy: fleetc.DistributedStrategy):
    make, optimizer_name = STAGED["gpt"]
    model = make(1)
    return model, fleetc.compile(model, strategy, optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                                 loss_fn=ZOO["gpt"].loss_fn)


def test_stages_write_their_parts_and_the_job_resumes_from_them(tmp_path):
    """5 steps, saved after 3 (the third step's gradient sums carried) and after 4 (an update boundary). New
    processes with other weights load the first and take steps 4 and 5: the same losses and parameters, bit for
    bit. The second loads into one process: through fleetc.read_checkpoint into a plain model, and into
    fleetc.compile without a pipeline; the first is refused there by name."""
    mid, boundary = str(tmp_path / "mid"), str(tmp_path / "boundary")
    args = {**ARGS, "saves": {"3": mid, "4": boundary}, "resume_after": 3}
    straight = _run("uninterrupted", args, tmp_path / "straight")
    losses, params = fleet_reference("gpt", 2, 2, 5, k_steps=2)   # the run itself is eager accumulation's
    for r in straight:
        torch.testing.assert_close(torch.tensor(r.result["losses"]), torch.tensor(losses))
        for name, value in r.result["params"].items():
            torch.testing.assert_close(value, params[name], msg=lambda m, name=name, rank=r.rank: f"rank {rank} {name}: {m}")
    version = checkpoint_commit.open_latest(mid, ())
    parts = {name: version.read(name) for name in version.meta["pipeline_parts"]}
    assert sorted(parts) == ["pipeline.pp00000.pt", "pipeline.pp00001.pt"]   # one part per stage, one commit
    assert version.read("model.pt") == {} and version.read("optimizer.pt")["state"] == {}   # all in the parts
    assert version.meta["tied"] == {"lm_head.weight": "tok.weight"}
    assert [name for name, part in parts.items() if "tok.weight" in part["model"]] == ["pipeline.pp00000.pt"]
    for index, part in enumerate(parts.values()):   # a stage's part: its parameters, their state, its merge sums
        assert set(part["model"]) == set(straight[index].result["params"]) - ({"tok.weight"} if index else set())
        assert len(part["optimizer"]) == len(part["model"])
        assert part["merge"]["steps_merged"] == 1 and list(part["merge"]["carried"]) == [index]

    resumed = _run("resumed", args, tmp_path / "resumed")
    for before, after in zip(straight, resumed):
        assert after.result["losses"] == before.result["losses"][3:]
        assert set(after.result["params"]) == set(before.result["params"])
        for name, value in after.result["params"].items():
            assert torch.equal(value, before.result["params"][name]), f"rank {after.rank} {name}"

    trained = {n: v for r in straight for n, v in r.result["params"].items()}  # step 5 merged, so as after step 4
    exp_avg = {n: v for r in straight for n, v in r.result["exp_avg"].items()}
    plain = STAGED["gpt"][0](1)
    plain.load_state_dict(fleetc.read_checkpoint(boundary)["model"])
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name
    assert torch.equal(plain.lm_head.weight, trained["tok.weight"])   # the tied head loads from the one copy
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    model, trainer = _single_process_trainer(strategy)
    with pytest.raises(fleetc.CheckpointError, match="between gradient-merge updates"):
        trainer.load_checkpoint(mid)
    _check_carried_sums_need_the_same_pipeline(mid, trainer)
    _check_refused_before_the_first_step(mid, boundary)
    trainer.load_checkpoint(boundary)
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[name]), name
        assert torch.equal(trainer.optimizer.state[p]["exp_avg"], exp_avg[name]), name


def _pipeline_strategy(**fields) -> fleetc.DistributedStrategy:
    """The checkpoint's writer's strategy (2 device_guard stages, 1F1B, k_steps=2), with `fields` changed."""
    strategy = fleetc.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"micro_batch_size": 1, "accumulate_steps": 2, "schedule_mode": "1F1B",
                                 **fields.pop("pipeline_configs", {})}
    strategy.gradient_merge, strategy.gradient_merge_configs = True, {"k_steps": ARGS["k_steps"]}
    for field, value in fields.items():
        setattr(strategy, field, value)
    return strategy


def _planned(**fields) -> tuple:
    """The layout a trainer of the strategy plans before its first step (comm/mesh.py; no capture)."""
    return pipeline_layout(resolve_conflicts(resolve_strategy(_pipeline_strategy(**fields)))[0], None)


def _check_carried_sums_need_the_same_pipeline(mid: str, trainer) -> None:
    """The mid-period checkpoint of 2 pipeline ranks, one chunk each, as a pipeline rank's trainer of another layout
    would load it: its carried sums are per chunk of the writer's cut, so 4 pipeline ranks (another depth) and 2
    ranks of 2 chunks (VPP) are refused by name, before anything is restored; the writer's layout takes them. The
    layouts as a trainer plans them from its strategy before its first step too: the depth from
    hybrid_configs.pp_degree, else unknown (device_guard decides it at capture; the rest is checked on the writer's)."""
    four_deep = _planned(hybrid_configs={"pp_degree": 4})
    assert four_deep == (4, 1, 2) and _planned(hybrid_configs={"pp_degree": 2}) == (2, 1, 2)
    assert _planned(pipeline_configs={"vpp_degree": 2, "schedule_mode": "VPP"},
                    hybrid_configs={"pp_degree": 4}) == (2, 2, 2)
    no_merge, vpp = _planned(gradient_merge=False), _planned(pipeline_configs={"vpp_degree": 2, "schedule_mode": "VPP"})
    assert (no_merge, vpp) == ((None, 1, 1), (None, 2, 2))
    by_depth = r"by a pipeline of 2 rank\(s\) \(parts \[0, 1\]\).*this pipeline has 4"
    by_chunks = (r"pipeline\.pp00000\.pt: carries the gradient sums of chunks \[0\] after 1 merged step\(s\), but "
                 r"this pipeline's rank 0 runs chunks \[0, 2\]")
    by_k_steps = r"pipeline\.pp00000\.pt: .* runs chunks \[0\] with k_steps=1"
    for layout, message in (((4, 1, 2), by_depth), ((2, 2, 2), by_chunks), ((2, 1, 1), by_k_steps),
                            (four_deep, by_depth), (vpp, by_chunks), (no_merge, by_k_steps)):
        state = dataclasses.replace(trainer._live_state(), pipeline_merges={}, pipeline_layout=layout)
        before = {name: value.clone() for name, value in trainer.model.state_dict().items()}
        with pytest.raises(fleetc.CheckpointError, match=message):
            load_checkpoint(mid, state, trainer.config)
        assert state.pipeline_merges == {}
        assert all(torch.equal(value, before[name]) for name, value in trainer.model.state_dict().items())
    for layout in (_planned(), _planned(hybrid_configs={"pp_degree": 2})):  # the writer's, planned
        state = dataclasses.replace(trainer._live_state(), pipeline_merges={}, pipeline_layout=layout)
        load_checkpoint(mid, state, trainer.config)
        assert sorted(state.pipeline_merges) == [0, 1]
    state = dataclasses.replace(trainer._live_state(), pipeline_merges={}, pipeline_layout=(2, 1, 2))
    load_checkpoint(mid, state, trainer.config)
    assert sorted(state.pipeline_merges) == [0, 1] and state.pipeline_merges[1]["steps_merged"] == 1


def _check_refused_before_the_first_step(mid: str, boundary: str) -> None:
    """A pipeline rank's trainer of another layout (4 device_guard stages, 2 chunks per rank: the pipeline of 2
    ranks the checkpoint came from, but another chunking) that loads the mid-period checkpoint before its first
    step: the load itself refuses it by name, and the model's parameters and buffers and the optimizer's state
    (restored from the update-boundary checkpoint first) are exactly as before. (Another k_steps is refused by the
    strategy-state check of fleetc.pt before this.) The trainer is built in this process and told it is one of 2
    ranks, as it is in a job: the load's checks need no collective."""
    make, optimizer_name = STAGED["gpt"]
    model = make(4)
    trainer = DataParallelTrainer(model, _pipeline_strategy(pipeline_configs={"vpp_degree": 2, "schedule_mode": "VPP"}),
                                  optimizer=OPTIMIZERS[optimizer_name](model.parameters()), loss_fn=ZOO["gpt"].loss_fn)
    trainer.world_size = 2  # a pipeline rank's trainer takes carried sums
    trainer.load_checkpoint(boundary)  # parameters and Adam state worth keeping
    model_before = {name: value.clone() for name, value in model.state_dict().items()}
    state_before = copy.deepcopy(trainer.optimizer.state_dict())
    with pytest.raises(fleetc.CheckpointError, match=r"pipeline\.pp00000\.pt: .* runs chunks \[0, 2\]"):
        trainer.load_checkpoint(mid)
    assert {m["steps_merged"] for m in trainer._resumed_merges.values()} == {0}  # still the boundary's
    for name, value in model.state_dict().items():
        assert torch.equal(value, model_before[name]), name
    state_after = trainer.optimizer.state_dict()
    assert state_after["state"].keys() == state_before["state"].keys() and state_before["state"]
    for index, slots in state_before["state"].items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(state_after["state"][index][key]), torch.as_tensor(value)), key


def test_amp_loss_scaling_state_round_trips_through_the_stage_parts(tmp_path):
    """AMP with a scale that grows after every clean update: saved at an update boundary (after 4 steps, 2 updates),
    new processes with other weights resume with the same scale and counters on both stages, and the next steps
    equal the uninterrupted run's, bit for bit. One process without a pipeline resumes the same scaling state:
    after the same two steps its counters equal the uninterrupted pipeline's."""
    amp = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 1}
    args = {**ARGS, "steps": 6, "amp_configs": amp, "saves": {"4": str(tmp_path / "boundary")}, "resume_after": 4}
    straight = _run("uninterrupted", args, tmp_path / "straight")
    version = checkpoint_commit.open_latest(tmp_path / "boundary", ())
    stored = {name: value for part in map(version.read, version.meta["pipeline_parts"])
              for name, value in part["owned"].items()}
    assert float(stored["loss_scaling"]) == 1024.0 * 2 ** 2  # grown once per clean update, stored once
    resumed = _run("resumed", args, tmp_path / "resumed")
    for before, after in zip(straight, resumed):
        assert float(before.result["counters"]["loss_scaling"]) == 1024.0 * 2 ** 3
        assert after.result["losses"] == before.result["losses"][4:]
        for name, value in before.result["counters"].items():
            assert torch.equal(after.result["counters"][name], value), f"rank {after.rank} {name}"
        for name, value in after.result["params"].items():
            assert torch.equal(value, before.result["params"][name]), f"rank {after.rank} {name}"
    strategy = fleetc.DistributedStrategy()  # another mesh: one process, no pipeline, the same scaling state
    strategy.gradient_merge, strategy.gradient_merge_configs = True, {"k_steps": ARGS["k_steps"]}
    strategy.amp, strategy.amp_configs = True, amp
    _, trainer = _single_process_trainer(strategy)
    trainer.load_checkpoint(str(tmp_path / "boundary"))
    g = torch.Generator().manual_seed(1)
    for batch in [ZOO["gpt"].make_batch(g)[0] for _ in range(args["steps"])][4:]:  # one more clean update
        trainer.step(*batch)
    for name in SCALING_STATE:
        assert torch.equal(trainer.counters[name], straight[0].result["counters"][name]), f"one process {name}"


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="4 processes on 2 cores: FLEETC_FULL=1 runs it; CI "
                    "runs pp x dp in passes/pipeline_parallel/test_replicas.py and this checkpoint on 2 processes")
def test_pp_times_dp_resumes_mid_period_from_the_replicas_average(tmp_path):
    """pp=2 × dp=2, saved mid gradient-merge period: only dp-rank 0 of each stage writes, its part holding the
    replicas' average carried sums; new processes resume and match the uninterrupted run (fp32 tolerance: the
    average is taken before, not after, the last step's sums are added). pp=4 on the same 4 processes (another
    depth: the sums are per chunk of the writer's cut) refuses it on every rank, by name: in the load when
    hybrid_configs.pp_degree gives the depth, at its first step when only the device_guard stages do."""
    args = {**ARGS, "saves": {"3": str(tmp_path / "mid")}, "resume_after": 3}
    straight = spawn(4, "uninterrupted", args, tmp_path / "straight", deadline_s=300,
                     module="fleet.pipeline_checkpoint_workers")
    version = checkpoint_commit.open_latest(tmp_path / "mid", ())
    assert version.meta["pipeline_parts"] == ["pipeline.pp00000.pt", "pipeline.pp00001.pt"]
    resumed = spawn(4, "resumed", args, tmp_path / "resumed", deadline_s=300,
                    module="fleet.pipeline_checkpoint_workers")
    for before, after in zip(straight, resumed):
        assert before.returncode == 0 and after.returncode == 0, (before.output + after.output)[-3000:]
        torch.testing.assert_close(torch.tensor(after.result["losses"]), torch.tensor(before.result["losses"][3:]))
        for name, value in after.result["params"].items():
            torch.testing.assert_close(value, before.result["params"][name],
                                       msg=lambda m, name=name, rank=after.rank: f"rank {rank} {name}: {m}")
    deeper = spawn(4, "refused", {**args, "stages": 4, "microbatches": 4}, tmp_path / "deeper", deadline_s=300,
                   module="fleet.pipeline_checkpoint_workers")
    for r in deeper:
        assert r.returncode == 0, r.output[-3000:]
        # the depth from hybrid_configs.pp_degree: the load refuses it; from device_guard alone: the first step
        assert r.result[4][0] == "load" and r.result[0][0] == "step", r.result
        assert "set hybrid_configs.pp_degree" in r.result[0][1] and "does not fit rank" in r.result[4][1]
        for _, error in r.result.values():
            assert "saved between gradient-merge updates by a pipeline of 2 rank(s)" in error
            assert "this pipeline has 4" in error, error
