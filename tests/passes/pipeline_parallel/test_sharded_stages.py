"""Sharding × pipeline at the Program level (no processes): the sharding pass leaves the whole Program to the split,
which shards each stage's optimizer Program over the stage's sharding group; stage 3 also keeps each stage's
parameters as pieces, gathered by the stage's gather Program. The numbers
are checked on 4 gloo processes in tests/fleet/test_sharded_pipeline.py."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from helpers.pipeline import STAGED, StagedGPT, staged_gpt_program

import fleetc
from fleetc.comm.mesh import ProcessMesh
from fleetc.errors import PassStrategyError
from fleetc.fleet.pipeline_state import chunk_state_pieces
from fleetc.fleet.sharded_params import sharded_parameters
from fleetc.fleet.sharded_state import state_pieces
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.program import OpRole, Program
from fleetc.passes.data_parallel import InsertAllreduce
from fleetc.passes.data_parallel.common import START
from fleetc.passes.optimizers.clip import GradientClip
from fleetc.passes.pipeline_parallel.split import PipelineSplit, pipeline_plan
from fleetc.passes.sharding import Sharding
from fleetc.passes.sharding.optimizer_sharding import GATHER, RS_START
from fleetc.passes.sharding.param_sharding import GATHER_START, GATHER_WAIT

MESH = ProcessMesh(pp=2, sharding=2)


def _split(stage: int, rank: int, mesh: ProcessMesh = MESH, fields: dict | None = None, clip=None, stages: int = 2):
    """The GPT's training Program (in `stages` device_guard stages) through the passes as rank `rank` of `mesh`
    compiles it (with the strategy's `fields` also set, the gradients clipped by `clip`): (program, plan, sharding
    pass report)."""
    program, config = staged_gpt_program(torch.optim.Adam, stages, sharding=True, sharding_configs={"stage": stage},
                                         **(fields or {}))
    if clip is not None:
        program, _ = GradientClip(clip).run(program, config)
    program.metadata["data_parallel"] = {"world_size": mesh.world_size // mesh.pp,
                                         "groups": mesh.groups("dp", "sharding")}
    program.metadata["sharding"] = sharding_metadata(mesh, rank)
    program, _ = InsertAllreduce().run(program, config)
    program, report = Sharding().run(program, config)
    program, _ = PipelineSplit().run(program, config)
    return program, pipeline_plan(program)[0], report


def _updated(optimizer) -> set[str]:
    return {op.attrs["param"] for op in optimizer.global_block.ops
            if OpRole.OPTIMIZE in op.role and op.attrs.get("param")}


@pytest.mark.parametrize("stage", [1, 2])
def test_each_stage_updates_only_what_its_sharding_rank_owns(stage):
    runs = [_split(stage, MESH.rank(sharding=i)) for i in range(2)]
    for program, plan, report in runs:
        assert "runs on each pipeline stage's optimizer Program" in report.notes[0]
        assert not [op for op in program.global_block.ops if op.type in (GATHER, RS_START)]  # the whole Program
        assert program.metadata["collective_groups"]["sharding"] == MESH.groups("sharding")
        assert f"sharding stage {stage}: in each stage's optimizer Program" in plan.describe()
    assert runs[0][1].describe() == runs[1][1].describe()  # what the ranks compare before the first step
    cut_anywhere = set()
    for s in range(2):
        stage_params = set(runs[0][1].stages[s].params)
        owned = [_updated(plan.stages[s].phases["optimizer"]) for _, plan, _ in runs]
        assert owned[0] and owned[1] and owned[0] | owned[1] == stage_params
        for _, plan, _ in runs:  # stage 2 on flat buckets: a parameter cut between the ranks, each updating a piece
            optimizer = plan.stages[s].phases["optimizer"]
            cut = {optimizer.metadata["state_bindings"][v][0] for v in optimizer.metadata.get("state_pieces", {})}
            assert owned[0] & owned[1] <= cut and (stage == 2 or not cut)
            cut_anywhere |= cut
        for index, (program, plan, _) in enumerate(runs):
            assert owned[index] <= set(program.metadata["sharding"]["owned"])
            types = [op.type for op in plan.stages[s].phases["optimizer"].global_block.ops]
            assert types.count(GATHER) >= 1 and types.index(GATHER) > max(
                i for i, op in enumerate(plan.stages[s].phases["optimizer"].global_block.ops)
                if OpRole.OPTIMIZE in op.role and op.attrs.get("param"))  # gathered after the last update
            assert (RS_START in types) == (stage == 2) and (START in types) == (stage == 1)
    assert bool(cut_anywhere) == (stage == 2)
    tied = runs[0][1].shared  # the tied embedding: summed over its stages before the sharded average
    assert tied
    for holders in tied.values():
        for s in holders:
            types = [op.type for op in runs[0][1].stages[s].phases["optimizer"].global_block.ops]
            assert types.index("fleetc.pipeline_shared_sum") < types.index(RS_START if stage == 2 else START)


def test_stage_3_holds_pieces_of_each_stage_and_gathers_them_once_per_step():
    """Stage 3: a stage's optimizer Program reduce-scatters and updates this rank's pieces, with no gather after the
    update; the parameter Vars there are the pieces, which cover each parameter once over the sharding group; the
    stage's gather Program all-gathers every bucket (all issued before the first wait) into the whole parameters
    the forward and backward read."""
    runs = [_split(3, MESH.rank(sharding=i)) for i in range(2)]
    assert runs[0][1].describe() == runs[1][1].describe()
    assert "sharding stage 3: each of a stage's 2 sharding ranks holds a flat piece" in runs[0][1].describe()
    for s in range(2):
        covered: dict[str, int] = {}
        for program, plan, _ in runs:
            stage = plan.stages[s]
            optimizer, gather = stage.phases["optimizer"], stage.phases["gather"]
            types = [op.type for op in optimizer.global_block.ops]
            assert RS_START in types and GATHER not in types and GATHER_START not in types
            pieces = program.metadata["sharding"]["stage_layouts"][s]["param_pieces"]
            for name in stage.params:
                lo, hi = pieces.get(name, (0, 0))
                covered[name] = covered.get(name, 0) + hi - lo
                held = optimizer.find_var(name)
                assert (held is None) == (name not in pieces)  # the Var of a parameter it holds nothing of: gone
                assert held is None or math.prod(held.shape) == hi - lo
                assert (gather.find_var(name) is None) == (name not in pieces)
            types = [op.type for op in gather.global_block.ops]
            issued = [i for i, kind in enumerate(types) if kind == GATHER_START]
            assert issued and max(issued) < types.index(GATHER_WAIT)
            read = {v.name for phase in ("forward", "backward") for v in stage.phases[phase].persistables()}
            assert set(gather.fetches) == read & set(stage.params)  # every parameter the compute reads, whole
        for name, elements in covered.items():  # the two ranks' pieces: the whole parameter, once
            assert elements == math.prod(_whole_shape(runs[0][1].stages[s], name)), name
        # the gathered stage, in flight through the step's compute: its float32 parameters, each bucket padded to a
        # multiple of the 2 ranks
        in_flight = int(re.search(rf"stage {s} (\d+)", runs[0][1].describe()).group(1))
        buckets = len(runs[0][0].metadata["sharding"]["stage_layouts"][s]["param_buckets"])
        assert 4 * sum(covered.values()) <= in_flight <= 4 * (sum(covered.values()) + buckets)


def test_stage_3_under_pipeline_keeps_each_parameter_in_the_dtype_its_programs_declare():
    """The pass records every parameter's declared dtype (use_pure_fp16 declares low precision) and the pipeline's
    held-parameter bookkeeping keeps each one in it, also a parameter of another stage or one this rank holds
    nothing of, so the ranks' whole copies (checkpoints, full_state_dict) agree in dtype."""
    program, _, _ = _split(3, 0)
    meta = program.metadata["sharding"]
    model = STAGED["gpt"][0](2)
    assert set(meta["param_dtypes"]) == {name for name, _ in model.named_parameters()}
    assert set(meta["param_dtypes"].values()) == {"float32"}
    declared = {name: "bfloat16" for name in meta["param_dtypes"]}  # as use_pure_fp16 declares them
    held = sharded_parameters(model, {"sharding": {**meta, "param_dtypes": declared}}, chunks=[0])
    assert set(held.dtypes.values()) == {torch.bfloat16}


def _whole_shape(stage, name: str) -> tuple:
    """The shape of parameter `name` as the stage's forward or backward reads it (whole)."""
    for phase in ("forward", "backward"):
        var = stage.phases[phase].find_var(name)
        if var is not None:
            return var.shape
    raise AssertionError(name)


def test_stage_3_under_pipeline_refuses_clip_by_norm_by_name():
    """ClipGradByNorm needs each parameter's whole gradient, and a pipeline stage under stage 3 holds pieces only."""
    with pytest.raises(PassStrategyError, match=r"stage 3 with pipeline: fleetc\.clip_by_norm reads whole gradients"):
        _split(3, 0, clip=fleetc.ClipGradByNorm(0.1))


def test_stage_3_under_pipeline_clips_by_the_norm_over_every_stage_and_piece():
    """Global-norm clipping: each rank's squared norm is over the gradient pieces it keeps (its shard's views),
    summed over its sharding group, then over the stages; every clip reads that sum. Clipping by value narrows to
    the kept pieces. Gradient merge leaves the optimizer Programs as they are (the runtime runs them once per
    k_steps steps, so their reduce-scatter too)."""
    for s in range(2):
        plan = _split(3, MESH.rank(pp=s), clip=fleetc.ClipGradByGlobalNorm(0.1))[1]
        optimizer = plan.stages[s].phases["optimizer"]
        ops = optimizer.global_block.ops
        kept = {name for op in ops if op.type == "fleetc.shard_views" for name in op.outputs}
        norm = next(op for op in ops if op.type == "fleetc.squared_global_norm")
        assert norm.args[0] and {ref.name for ref in norm.args[0]} <= kept
        summed = next(op for op in ops if op.type == "fleetc.c_sharding_norm_sum")
        over_stages = next(op for op in ops[ops.index(summed):] if op.type == "fleetc.pipeline_shared_sum")
        assert summed.args[0].name == norm.outputs[0] and over_stages.args[0].name == summed.outputs[0]
        clip = next(op for op in ops if op.type == "fleetc.clip_by_global_norm")
        assert ops.index(over_stages) < ops.index(clip) and {ref.name for ref in clip.args[0]} <= kept
        by_value = _split(3, MESH.rank(pp=s), clip=fleetc.ClipGradByValue(0.1))[1].stages[s].phases["optimizer"]
        clipped = [op for op in by_value.global_block.ops if op.type == "fleetc.clip_by_value"]
        assert clipped and all(ref.name in kept for op in clipped for ref in op.args[0])
    merged = _split(3, 0, fields={"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}})[1]
    assert str(merged.stages[0].phases["optimizer"]) == str(_split(3, 0)[1].stages[0].phases["optimizer"])


@pytest.mark.parametrize("stage", [2, 3])
def test_with_data_parallel_replicas_the_shards_are_averaged_over_the_dp_axis(stage):
    """dp=2 × pp=2 × sharding=2 (8 ranks, Program level only): a stage's replicas are 4 ranks; stages 2 and 3
    reduce-scatter over the 2-rank sharding group, then sum the shard over the dp axis; stage 3 gathers the
    parameters over the sharding group only."""
    mesh = ProcessMesh(dp=2, pp=2, sharding=2)
    program, plan, _ = _split(stage, mesh.rank(dp=1, pp=1, sharding=1), mesh)
    groups = program.metadata["collective_groups"]
    assert groups["dp:0"] == mesh.groups("dp", "sharding") and groups["sharding"] == mesh.groups("sharding")
    assert groups["sharding_dp"] == mesh.groups("dp")
    for chunk in plan.stages:
        scatter = next(op for op in chunk.phases["optimizer"].global_block.ops if op.type == RS_START)
        assert scatter.args[3:5] == ("sharding", "sharding_dp")
        gathers = [op for op in chunk.phases.get("gather", Program()).global_block.ops if op.type == GATHER_START]
        assert bool(gathers) == (stage == 3) and all(op.args[4] == "sharding" for op in gathers)


def test_a_vpp_rank_keeps_and_saves_the_pieces_of_every_chunk_it_runs():
    """VPP (pp=2, 2 chunks per pipeline rank) × stage 3: pipeline rank 0 runs chunks 0 and 2, each chunk's
    optimizer Program keeping pieces of its own parameters' state. The pieces a rank's optimizer shard file lists
    (`chunk_state_pieces`) are both chunks' (a checkpoint listing only the first chunk's did not load), and over
    the sharding group they cover each cut parameter's state once."""
    vpp = {"pipeline_configs": {"micro_batch_size": 1, "accumulate_steps": 2, "schedule_mode": "VPP",
                                "vpp_degree": 2}}
    model = StagedGPT(4)
    optimizer = torch.optim.Adam(model.parameters())
    numel = [p.numel() for p in model.parameters()]
    covered: dict[int, int] = {}
    for i in range(2):
        _, plan, _ = _split(3, MESH.rank(pp=0, sharding=i), fields=vpp, stages=4)
        pipe = SimpleNamespace(chunks=[0, 2], plan=plan)
        pieces = chunk_state_pieces(pipe, optimizer, model)
        per_chunk = [state_pieces(plan.stages[s].phases["optimizer"].metadata, optimizer, model) for s in (0, 2)]
        assert all(per_chunk) and sorted(per_chunk[0] + per_chunk[1]) == pieces
        for index, lo, hi in pieces:
            covered[index] = covered.get(index, 0) + hi - lo
    assert covered and all(n == numel[index] for index, n in covered.items()), covered
