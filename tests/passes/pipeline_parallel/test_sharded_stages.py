"""Sharding × pipeline at the Program level (no processes): the sharding pass leaves the whole Program to the split,
which shards each stage's optimizer Program over the stage's sharding group; stage 3 is refused by name. The numbers
are checked on 4 gloo processes in tests/fleet/test_sharded_pipeline.py."""
from __future__ import annotations

import pytest
import torch
from helpers.pipeline import staged_gpt_program

from fleetc.comm.mesh import ProcessMesh
from fleetc.errors import PassStrategyError
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.program import OpRole
from fleetc.passes.data_parallel import InsertAllreduce
from fleetc.passes.data_parallel.common import START
from fleetc.passes.pipeline_parallel.split import PipelineSplit, pipeline_plan
from fleetc.passes.sharding import Sharding
from fleetc.passes.sharding.optimizer_sharding import GATHER, RS_START

MESH = ProcessMesh(pp=2, sharding=2)


def _split(stage: int, rank: int, mesh: ProcessMesh = MESH):
    """The GPT's training Program through the passes as rank `rank` of `mesh` compiles it: (program, plan, sharding
    pass report)."""
    program, config = staged_gpt_program(torch.optim.Adam, sharding=True, sharding_configs={"stage": stage})
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


def test_stage_3_under_pipeline_is_refused_by_name():
    with pytest.raises(PassStrategyError, match="sharding_configs.stage 3 with pipeline is not supported"):
        _split(3, 0)


def test_with_data_parallel_replicas_the_shards_are_averaged_over_the_dp_axis():
    """dp=2 × pp=2 × sharding=2 (8 ranks, Program level only): a stage's replicas are 4 ranks; stage 2 reduce-scatters
    over the 2-rank sharding group, then sums the shard over the dp axis."""
    mesh = ProcessMesh(dp=2, pp=2, sharding=2)
    program, plan, _ = _split(2, mesh.rank(dp=1, pp=1, sharding=1), mesh)
    groups = program.metadata["collective_groups"]
    assert groups["dp:0"] == mesh.groups("dp", "sharding") and groups["sharding"] == mesh.groups("sharding")
    assert groups["sharding_dp"] == mesh.groups("dp")
    for stage in plan.stages:
        scatter = next(op for op in stage.phases["optimizer"].global_block.ops if op.type == RS_START)
        assert scatter.args[3:5] == ("sharding", "sharding_dp")
