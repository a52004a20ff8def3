"""Sharding × pipeline on 4 gloo processes (pp=2 × sharding=2): each stage's optimizer update is sharded over its
sharding group (ZeRO stage 1: owners update, parameters all-gathered; stage 2: the gradient average is a
reduce-scatter). Every rank matches eager PyTorch accumulating over the same micro-batches of every replica; each
rank holds optimizer state only for the parameters it owns. GPT ties its embeddings across the two stages: the
tied gradient's sum over stages and the sharded update compose. The GPT run under stage 2 also checkpoints: each
stage's part and each (stage, sharding rank)'s optimizer shard in one commit, resumed on the same mesh, in one
process, and (resharding) on 2 processes as pp=2 alone and as flat stage 2 alone; with FLEETC_FULL=1 the latter's
own checkpoint resumes as pp=2 × sharding=2 on 4."""
from __future__ import annotations

import os
import pathlib

import pytest
import torch
from helpers.pipeline import STAGED, eager_reference_run, fleet_reference
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleet.spawn import spawn, start
from fleetc.comm.mesh import ProcessMesh
from fleetc.errors import CheckpointError
from fleetc.fleet.sharded_state import SHARD_FILE
from fleetc.passes.data_parallel.common import START
from fleetc.passes.pipeline_parallel.clip import GLOBAL as GLOBAL_CLIP
from fleetc.passes.pipeline_parallel.clip import SQUARED_NORM
from fleetc.passes.sharding.clip_sharding import NORM_SUM
from fleetc.passes.sharding.optimizer_sharding import (
    CHECK_FINITE,
    FOUND_INF_MAX,
    GATHER,
    RS_START,
)
from fleetc.passes.sharding.param_sharding import GATHER_START as PARAM_GATHER_START
from fleetc.passes.sharding.param_sharding import GATHER_WAIT as PARAM_GATHER_WAIT
from fleetc.runtime import checkpoint_commit

pytestmark = pytest.mark.slow  # CI still runs them
SHARED_SUM = "fleetc.pipeline_shared_sum"  # a value summed over the pipeline stages

STEPS, MICROBATCHES, STAGES, SHARDS = 2, 2, 2, 2
RESUMED = 2  # steps the other meshes take after loading the checkpoint
# the meshes that resume a checkpoint another mesh wrote: (processes, pipeline stages, sharding stage, micro-batches
# per replica), each taking the global batch as the writer did
RESHARDED = {"pp2": (2, 2, None, SHARDS * MICROBATCHES), "sharding2": (2, 1, 2, 1),
             "pp2_sharding2": (STAGES * SHARDS, STAGES, 2, MICROBATCHES), "pp4": (4, 4, None, 4),
             "sharding4": (4, 1, 2, 1), "stage3": (2, 1, 3, 1), "pp2_stage3": (STAGES * SHARDS, STAGES, 3, MICROBATCHES)}
# (zoo model, sharding stage, global-norm clip, gradient merge k_steps): ClipGradByGlobalNorm's norm sums over the
# sharding group (stage 2 keeps only owned gradients) and over the stages; gradient merge runs the sharded update
# every k_steps steps
CASES = [("gpt", 2, None, 1)] + ([("gpt", 1, None, 1), ("cnn", 1, None, 1), ("cnn", 2, None, 1),
                                  ("gpt", 2, 0.05, 1), ("gpt", 2, None, 2)] if os.environ.get("FLEETC_FULL") else [])


@pytest.mark.parametrize("zoo_name, stage, clip_norm, k_steps", CASES)
def test_sharded_stages_of_a_pipeline_match_eager(zoo_name, stage, clip_norm, k_steps, tmp_path):
    args = {"model": zoo_name, "mode": "1F1B", "microbatches": MICROBATCHES, "steps": STEPS * k_steps,
            "stages": STAGES, "batch": 4, "sharding_stage": stage, "clip_norm": clip_norm, "k_steps": k_steps,
            "evaluate": zoo_name == "gpt",  # GPT: no BatchNorm statistics, which each replica keeps its own of
            "checkpoint": (zoo_name, clip_norm, k_steps) == ("gpt", None, 1)}
    results = spawn(STAGES * SHARDS, "fleet_train", args, tmp_path, deadline_s=300, module="fleet.pipeline_workers")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    mesh = ProcessMesh(pp=STAGES, sharding=SHARDS)
    losses, params = fleet_reference(zoo_name, STAGES, SHARDS * MICROBATCHES, STEPS * k_steps, k_steps,
                                     clip_norm)
    if args["evaluate"]:  # evaluation on every rank sees every stage's current, whole parameters
        _check_evaluation(results, zoo_name, params, STEPS * k_steps)
    owners: dict[tuple[int, str], list[int]] = {}
    for r in results:
        assert r.result["executor"] == "DistributedPipeline" and r.result["mesh"] == str(mesh)
        pipeline = [results[q] for q in mesh.group_of("pp", r.rank)]
        assert all(p.result["losses"] == r.result["losses"] for p in pipeline)  # one loss per pipeline
        for name, value in r.result["params"].items():  # whole and current on every rank of the stage
            torch.testing.assert_close(value, params[name],
                                       msg=lambda m, name=name, rank=r.rank: f"rank {rank} {name}: {m}")
        sharding = r.result["sharding"]
        ops = sharding["optimizer_ops"]
        assert ops.count(GATHER) >= 1 and (RS_START in ops) == (stage == 2) and (START in ops) == (stage == 1)
        owned = set(sharding["owned"]) & set(r.result["params"])
        assert set(sharding["state"]) == owned  # optimizer state for the owned parameters (or pieces) only
        if stage == 2:  # flat buckets: each rank's state holds only its pieces, some of them cut
            assert sharding["state_pieces"] >= 1 and sharding["state_elements"] < sum(
                r.result["params"][name].numel() for name in owned) * 2
        for name in owned:
            owners.setdefault((mesh.coordinates(r.rank)["pp"], name), []).append(r.rank)
    for s in range(STAGES):  # each stage's parameters: one owner in its sharding group (stage 2: pieces, maybe two)
        stage_params = set(results[mesh.rank(pp=s)].result["params"])
        assert {name for (t, name) in owners if t == s} == stage_params
        assert all(len(ranks) == 1 for (t, _), ranks in owners.items() if t == s) or stage == 2
    assert {r for ranks in owners.values() for r in ranks} == set(range(STAGES * SHARDS))  # everyone owns some
    if zoo_name == "gpt":
        assert all("tok.weight" in r.result["params"] for r in results)  # tied: both stages hold it
    replica_losses = torch.tensor([results[mesh.rank(sharding=i)].result["losses"] for i in range(SHARDS)])
    torch.testing.assert_close(replica_losses.mean(0), torch.tensor(losses, dtype=replica_losses.dtype))
    _check_memory(results, stage)
    if args["checkpoint"]:
        _check_checkpoint(results, tmp_path / "checkpoint")
        _check_resharding(tmp_path / "checkpoint", tmp_path)
        _check_misfits(tmp_path / "checkpoint")


@pytest.mark.parametrize("vpp, clip_norm, k_steps", [(1, None, 1), (1, 0.05, 2)]
                         + ([(2, None, 1)] if os.environ.get("FLEETC_FULL") else []))
def test_stage_3_of_a_pipeline_holds_pieces_and_matches_eager(vpp, clip_norm, k_steps, tmp_path):
    """Stage 3: each rank holds a flat piece of its stage's parameters between steps; the stage's gather Program
    makes them whole once per step, the optimizer Program reduce-scatters and updates the pieces. Every rank
    matches eager PyTorch (losses, every parameter), full_state_dict is whole on every rank, evaluation and the
    checkpoint (saved whole, resumed on the same mesh, in one process, as pp=2 alone and as flat stage 3 alone, on
    2 processes each; with FLEETC_FULL=1 also as pp=4 on 4, and pp=2's checkpoint then as pp=2 × sharding=2 stage
    3) work. vpp=2 (FLEETC_FULL=1): the interleaved schedule, two chunks of the GPT per pipeline rank, each chunk's
    parameters in pieces over the sharding group. Composed, in one run: global-norm clipping (the norm's squares
    summed over the stage's sharding group, then over the stages) and gradient merge (the optimizer Program, so its
    reduce-scatter, runs once per k_steps steps), against eager PyTorch clipping the global norm of the gradients
    averaged over k_steps steps."""
    steps = STEPS * k_steps
    args = {"model": "gpt", "mode": "VPP" if vpp > 1 else "1F1B", "microbatches": MICROBATCHES, "steps": steps,
            "stages": STAGES, "vpp": vpp, "batch": 4, "sharding_stage": 3, "evaluate": True,
            "checkpoint": k_steps == 1, "clip_norm": clip_norm, "k_steps": k_steps}
    results = spawn(STAGES * SHARDS, "fleet_train", args, tmp_path, deadline_s=300, module="fleet.pipeline_workers")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    mesh = ProcessMesh(pp=STAGES, sharding=SHARDS)
    losses, params = fleet_reference("gpt", STAGES, SHARDS * MICROBATCHES, steps, k_steps, clip_norm)
    _check_evaluation(results, "gpt", params, steps)
    expected = _trained("gpt", params).state_dict()
    for r in results:
        assert r.result["executor"] == "DistributedPipeline" and r.result["mesh"] == str(mesh)
        assert all(results[q].result["losses"] == r.result["losses"] for q in mesh.group_of("pp", r.rank))
        for name, value in r.result["params"].items():
            torch.testing.assert_close(value, params[name],
                                       msg=lambda m, name=name, rank=r.rank: f"rank {rank} {name}: {m}")
        assert set(r.result["full"]) == set(expected)  # every stage's parameters and buffers, whole
        for name, value in r.result["full"].items():
            torch.testing.assert_close(value, expected[name],
                                       msg=lambda m, name=name, rank=r.rank: f"rank {rank} full {name}: {m}")
        ops, gathers = r.result["sharding"]["optimizer_ops"], r.result["sharding"]["gather_ops"]
        assert RS_START in ops and GATHER not in ops and PARAM_GATHER_START not in ops  # no gather after the update
        issued = [i for i, kind in enumerate(gathers) if kind == PARAM_GATHER_START]
        assert issued and max(issued) < gathers.index(PARAM_GATHER_WAIT)  # every bucket in flight, then waited for
    for s in range(STAGES):  # between steps the stage's sharding ranks hold disjoint pieces that cover it once
        group = [results[q] for q in mesh.group_of("sharding", mesh.rank(pp=s))]
        whole = sum(value.numel() for value in group[0].result["params"].values())
        held = [sum(r.result["held"].values()) for r in group]
        assert sum(held) == whole and max(held) < whole, (s, held, whole)
        assert all(0 < h <= -(-whole // SHARDS) + SHARDS for h in held), held  # about even
    replica_losses = torch.tensor([results[mesh.rank(sharding=i)].result["losses"] for i in range(SHARDS)])
    torch.testing.assert_close(replica_losses.mean(0), torch.tensor(losses, dtype=replica_losses.dtype))
    _check_memory(results, 3)
    if clip_norm is not None:  # the squared norm of this rank's pieces, summed over the sharding group, then stages
        order = [kind for kind in results[0].result["sharding"]["optimizer_ops"]
                 if kind in (SQUARED_NORM, NORM_SUM, SHARED_SUM, GLOBAL_CLIP)]
        assert order == [SHARED_SUM, SQUARED_NORM, NORM_SUM, SHARED_SUM, GLOBAL_CLIP], order
    if args["checkpoint"]:
        _check_checkpoint(results, tmp_path / "checkpoint")
        # another mesh: pp=2 without sharding, and flat stage 3 without a pipeline, both at once (4 processes)
        jobs = {name: _resume(name, tmp_path / "checkpoint", STEPS, tmp_path) for name in ("pp2", "stage3")}
        for name, job in jobs.items():
            _check_resumed(name, job.collect(), STEPS, tmp_path)
        if os.environ.get("FLEETC_FULL"):  # another pipeline depth: pp=4; and pp=2's checkpoint back into stage 3 × pp
            _check_resumed("pp4", _resume("pp4", tmp_path / "checkpoint", STEPS, tmp_path).collect(), STEPS, tmp_path)
            skip = STEPS + RESUMED
            resumed = _resume("pp2_stage3", tmp_path / "pp2" / "checkpoint", skip, tmp_path).collect()
            _check_resumed("pp2_stage3", resumed, skip, tmp_path)


# bf16 AMP whose first step overflows (a scale of 1e38) on some rank's gradients: every rank must skip it, then
# continue at 1e8
OVERFLOWING_AMP = {"init_loss_scaling": 1e38, "decr_every_n_nan_or_inf": 1, "decr_ratio": 1e-30,
                   "incr_every_n_steps": 1}


# bf16 pure AMP (O2: the whole model in bfloat16, float32 master weights) with the overflowing first step
PURE = {**OVERFLOWING_AMP, "use_pure_fp16": True, "use_fp16_guard": False}

# the compositions checked against the unsharded pipeline: (extra worker arguments, steps, bit for bit); the sharding
# stage is 3 unless the extra arguments name another
COMPOSED = {"amp": ({"amp": OVERFLOWING_AMP}, 3, True),
            "clip_merge": ({"clip_norm": 0.05, "k_steps": 2}, 4, False),  # the norm sums pieces: to rounding
            "amp_clip_merge": ({"amp": OVERFLOWING_AMP, "clip_norm": 0.05, "k_steps": 2}, 6, False),
            "pure": ({"amp": PURE}, 3, True),
            "pure_stage1": ({"amp": PURE, "sharding_stage": 1}, 3, True),
            "pure_stage2": ({"amp": PURE, "sharding_stage": 2}, 3, True)}


@pytest.mark.skipif(not os.environ.get("FLEETC_FULL"), reason="two 4-process runs each; FLEETC_FULL=1 runs them")
@pytest.mark.parametrize("composed", sorted(COMPOSED))
def test_sharded_pipeline_composed_equals_the_unsharded_pipeline(composed, tmp_path):
    """Stage 3 × pipeline under AMP (bf16, dynamic loss scaling), global-norm clipping with gradient merge, and all
    three; and stages 1, 2 and 3 × pipeline under use_pure_fp16 (bf16): each against pp=2 × dp=2 without sharding
    under the same strategy. AMP: each rank checks only the gradient pieces it keeps (stages 2 and 3), found_inf
    is max-allreduced over the stage's sharding group and then summed over the stages, so the whole pp × sharding
    mesh skips the overflowing first step together and keeps the same loss-scaling state. Losses, every parameter
    and the scaling state equal the unsharded run's, bit for bit without clipping (with it the squared norm is
    summed piece by piece: fp32 tolerance). use_pure_fp16: every parameter is bfloat16 on both runs, and under
    stage 3 so is every parameter of full_state_dict(), equal to the unsharded run's."""
    extra, steps, exact = COMPOSED[composed]
    stage = extra.get("sharding_stage", 3)
    args = {"model": "gpt", "mode": "1F1B", "microbatches": MICROBATCHES, "steps": steps, "stages": STAGES,
            "batch": 4, **extra}
    sharded, unsharded = (spawn(STAGES * SHARDS, "fleet_train", {**args, "sharding_stage": s}, tmp_path / str(s),
                                deadline_s=300, module="fleet.pipeline_workers") for s in (stage, None))
    for r in [*sharded, *unsharded]:
        assert r.returncode == 0, r.output[-3000:]
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1.3e-6, atol=1e-5))
    reference = {name: value for r in unsharded for name, value in r.result["params"].items()}
    scaling = unsharded[0].result["scaling"]
    assert all(r.result["scaling"] == scaling for r in unsharded)
    if "amp" in extra:  # the first step overflowed and was skipped
        assert scaling[0] < OVERFLOWING_AMP["init_loss_scaling"]
    pure = extra.get("amp", {}).get("use_pure_fp16", False)
    if pure:
        assert {value.dtype for value in reference.values()} == {torch.bfloat16}
    mesh, plain = ProcessMesh(pp=STAGES, sharding=SHARDS), ProcessMesh(dp=SHARDS, pp=STAGES)
    for r in sharded:
        ops = r.result["sharding"]["optimizer_ops"]
        if "amp" in extra and stage > 1:
            assert ops.index(CHECK_FINITE) < ops.index(FOUND_INF_MAX) < ops.index(SHARED_SUM,
                                                                                 ops.index(FOUND_INF_MAX))
        elif "amp" in extra:  # stage 1: each rank checks the whole averaged gradients, found_inf summed over stages
            assert FOUND_INF_MAX not in ops and ops.index(CHECK_FINITE) < ops.index(SHARED_SUM, ops.index(CHECK_FINITE))
        assert r.result["scaling"] == scaling, r.rank
        replica = mesh.coordinates(r.rank)["sharding"]
        expected = unsharded[plain.rank(dp=replica, pp=0)].result["losses"]
        assert same(torch.tensor(r.result["losses"]), torch.tensor(expected)), (r.rank, r.result["losses"], expected)
        for name, value in r.result["params"].items():
            assert same(value, reference[name]), (r.rank, name, (value - reference[name]).abs().max())
        if pure and stage == 3:  # every stage's parameters, those this rank holds nothing of included
            full = {name: r.result["full"][name] for name in reference}
            assert {value.dtype for value in full.values()} == {torch.bfloat16}, r.rank
            assert all(torch.equal(value, reference[name]) for name, value in full.items()), r.rank


def _check_memory(results: list, stage: int) -> None:
    """memory_stats() counts this rank's pipeline stage: Ψ is the stage's parameters (not the whole model's), and
    the measured parameter, gradient and optimizer-state bytes are within 10% of the formula for that Ψ; under
    stage 3 the stage's whole parameters are in flight during the step."""
    for r in results:
        memory = r.result["memory"]
        numel = sum(value.numel() for value in r.result["params"].values())
        assert memory["stage"] == stage and memory["degree"] == SHARDS and memory["parameters"] == numel, memory
        assert abs(memory["total_bytes"] - memory["formula_bytes"]) <= 0.1 * memory["formula_bytes"], (r.rank, memory)
        assert (memory["gathered_in_flight_bytes"] >= 4 * numel) == (stage == 3), (r.rank, memory)


def _check_evaluation(results: list, zoo_name: str, params: dict, steps: int) -> None:
    """Every rank's evaluation of the last batch is the reference model's with the trained parameters."""
    reference = _trained(zoo_name, params)
    g = torch.Generator().manual_seed(1)
    batches = [ZOO[zoo_name].make_batch(g)[0] for _ in range(steps)]
    with torch.no_grad():
        expected = reference.eval()(batches[-1][0])
    for r in results:
        torch.testing.assert_close(r.result["evaluated"], expected)


def _trained(zoo_name: str, params: dict) -> torch.nn.Module:
    """The staged zoo model holding the reference's trained parameters."""
    make, _ = STAGED[zoo_name]
    reference = make(STAGES)
    reference.load_state_dict({**reference.state_dict(), **params})
    return reference


def _check_checkpoint(results: list, checkpoint: pathlib.Path) -> None:
    """Saved after STEPS steps: each stage's first sharding rank wrote the stage's part (its parameters, the tied
    embedding once), each (stage, sharding rank) its optimizer shard, in one commit. The same mesh resumed from it
    takes the next step as the uninterrupted eager run does; so does one process (fleetc.compile without pipeline
    or sharding), and fleetc.read_checkpoint gives the whole model."""
    version = checkpoint_commit.open_latest(str(checkpoint), ())
    assert version.meta["pipeline_parts"] == ["pipeline.pp00000.pt", "pipeline.pp00001.pt"]
    assert version.meta["optimizer_shards"] == [SHARD_FILE.format(i) for i in range(STAGES * SHARDS)]
    assert version.meta["tied"] == {"lm_head.weight": "tok.weight"}
    assert version.read("optimizer.pt")["state"] == {}  # all of it in the shard files
    assert all(version.read(name)["optimizer"] == {} for name in version.meta["pipeline_parts"])
    held = version.meta["optimizer_shard_params"]
    pieces = version.meta.get("optimizer_shard_pieces", {})
    whole_in = [i for name in version.meta["optimizer_shards"] for i in held[name]
                if i not in {index for index, _, _ in pieces.get(name, ())}]
    make, optimizer_name = STAGED["gpt"]
    model = make(STAGES)
    cut = {index for split in pieces.values() for index, _, _ in split}  # flat stage 2: cut between two ranks
    assert sorted(whole_in + sorted(cut)) == list(range(len(list(model.parameters()))))  # every one's state, once
    _, saved_model, saved_optimizer = eager_reference_run("gpt", STAGES, SHARDS * MICROBATCHES, STEPS)
    saved = {n: p.detach() for n, p in saved_model.named_parameters()}
    _, continued = fleet_reference("gpt", STAGES, SHARDS * MICROBATCHES, STEPS + 1)
    whole = fleetc.read_checkpoint(str(checkpoint))
    for name, value in saved.items():
        torch.testing.assert_close(whole["model"][name], value, msg=lambda m, name=name: f"{name}: {m}")
    assert whole["model"]["lm_head.weight"] is whole["model"]["tok.weight"]
    trainer = fleetc.compile(model, optimizer=OPTIMIZERS[optimizer_name](model.parameters()),
                             loss_fn=ZOO["gpt"].loss_fn)
    trainer.load_checkpoint(str(checkpoint))
    _check_optimizer_state("one process", trainer.optimizer.state_dict()["state"], saved_optimizer)
    g = torch.Generator().manual_seed(1)
    batch = [ZOO["gpt"].make_batch(g)[0] for _ in range(STEPS + 1)][-1]
    trainer.step(*batch)
    for name, p in model.named_parameters():  # Adam's moments restored whole: the same update
        torch.testing.assert_close(p.detach(), continued[name], msg=lambda m, name=name: f"one process {name}: {m}")
    for r in results:  # the same mesh, fresh trainers, resumed from it
        assert r.result["resumed"]
        for name, value in r.result["resumed"].items():
            torch.testing.assert_close(value, continued[name],
                                       msg=lambda m, name=name, rank=r.rank: f"rank {rank} resumed {name}: {m}")


def _check_resharding(checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Resharding: the checkpoint of pp=2 × sharding=2 (flat stage 2: Adam's moments in pieces, some cut between
    two ranks) resumes on 2 processes as pp=2 without sharding and as sharding stage 2 without a pipeline, and on 4
    as pp=4 (another pipeline depth: each stage's part is re-cut). With FLEETC_FULL=1 it also resumes as flat
    stage 2 on 4 (pp=1 × sharding=4), pp=4's own checkpoint resumes as pp=2 × sharding=2, and so does flat stage 2's
    on 2."""
    jobs = {name: _resume(name, checkpoint, STEPS, tmp_path) for name in ("pp2", "sharding2")}
    for name, job in jobs.items():  # both at once: 4 processes, as the writer ran
        _check_resumed(name, job.collect(), STEPS, tmp_path)
    _check_resumed("pp4", _resume("pp4", checkpoint, STEPS, tmp_path).collect(), STEPS, tmp_path)
    if os.environ.get("FLEETC_FULL"):
        _check_resumed("sharding4", _resume("sharding4", checkpoint, STEPS, tmp_path).collect(), STEPS, tmp_path)
        skip = STEPS + RESUMED
        for writer in ("sharding2", "pp4"):
            label = f"pp2_sharding2_from_{writer}"
            job = _resume("pp2_sharding2", tmp_path / writer / "checkpoint", skip, tmp_path, label)
            _check_resumed("pp2_sharding2", job.collect(), skip, tmp_path, label)


def _resume(name: str, checkpoint: pathlib.Path, skip: int, tmp_path: pathlib.Path, label: str | None = None):
    """Start the mesh RESHARDED[name] resuming `checkpoint` (saved after `skip` steps) for RESUMED steps; it saves
    its own checkpoint into tmp_path/label/checkpoint (label: the name unless given)."""
    world, stages, stage, microbatches = RESHARDED[name]
    label = label or name
    return start(world, "fleet_resume", {"model": "gpt", "mode": "1F1B", "batch": 4, "stages": stages,
                                         "sharding_stage": stage, "microbatches": microbatches,
                                         "load": str(checkpoint), "skip": skip, "steps": RESUMED,
                                         "save": str(tmp_path / label / "checkpoint")},
                 tmp_path / label, deadline_s=240, module="fleet.pipeline_workers")


def _check_resumed(name: str, results: list, skip: int, tmp_path: pathlib.Path, label: str | None = None) -> None:
    """The resumed mesh RESHARDED[name] continued as the uninterrupted eager run does (losses, every parameter,
    whole), and the checkpoint it saved then has its own layout and holds the eager run's optimizer state (moments
    and step counts)."""
    label = label or name
    for r in results:
        assert r.returncode == 0, f"{label} rank {r.rank}: {r.output[-3000:]}"
    world, stages, stage, _ = RESHARDED[name]
    assert results[0].result["mesh"] == str(ProcessMesh(pp=stages, sharding=world // stages))
    meta = checkpoint_commit.open_latest(tmp_path / label / "checkpoint", ()).meta
    assert len(meta.get("pipeline_parts", ())) == (stages if stages > 1 else 0)
    assert len(meta.get("optimizer_shards", ())) == (world if stage else 0)
    assert bool(meta.get("optimizer_shard_pieces")) == (stage in (2, 3))  # flat buckets re-split the moments
    losses, model, optimizer = eager_reference_run("gpt", STAGES, SHARDS * MICROBATCHES, skip + RESUMED)
    # one loss per pipeline and replica, each the mean over its replica's share of the batch
    rank_losses = torch.tensor([r.result["losses"] for r in results])
    torch.testing.assert_close(rank_losses.mean(0), torch.tensor(losses[skip:]),
                               msg=lambda m: f"{label} losses: {m}")
    continued = {key: p.detach() for key, p in model.named_parameters()}
    held = {}
    for r in results:
        held.update(r.result["params"])
        for key, value in r.result["params"].items():
            torch.testing.assert_close(value, continued[key],
                                       msg=lambda m, key=key, r=r: f"{label} rank {r.rank} {key}: {m}")
    assert set(held) == set(continued)
    saved = fleetc.read_checkpoint(str(tmp_path / label / "checkpoint"))["optimizer"]["state"]
    _check_optimizer_state(label, saved, optimizer)


def _check_optimizer_state(label: str, state: dict, optimizer: torch.optim.Optimizer) -> None:
    """`state` (an optimizer state_dict's, by parameter index) is the eager `optimizer`'s: every parameter's Adam
    moments and step count (flat pieces joined come back flattened)."""
    expected = optimizer.state_dict()["state"]
    assert sorted(state) == sorted(expected), label
    for index, slots in expected.items():
        assert sorted(state[index]) == sorted(slots), (label, index)
        for key, value in slots.items():
            torch.testing.assert_close(state[index][key].reshape(value.shape), value,
                                       msg=lambda m, index=index, key=key: f"{label} {index} {key}: {m}")


def _check_misfits(checkpoint: pathlib.Path) -> None:
    """What cannot resume from the checkpoint is refused by name: another model (a parameter of another shape: the
    stage part holding it is named), and the same parameters numbered in another order by the optimizer (the
    shards' pieces would be joined into the wrong parameters)."""
    make, optimizer_name = STAGED["gpt"]
    other = make(STAGES)
    other.ln_f = torch.nn.LayerNorm(2 * other.ln_f.normalized_shape[0])
    reordered = make(STAGES)
    for model, params, message in ((other, other.parameters(), r"pipeline\.pp00001\.pt: 'ln_f\.weight' has shape"),
                                   (reordered, list(reordered.parameters())[::-1],
                                    r"optimizer\.pt: its optimizer state numbers 'tok\.weight' as parameter 0")):
        trainer = fleetc.compile(model, optimizer=OPTIMIZERS[optimizer_name](params), loss_fn=ZOO["gpt"].loss_fn)
        with pytest.raises(CheckpointError, match=message):
            trainer.load_checkpoint(str(checkpoint))
