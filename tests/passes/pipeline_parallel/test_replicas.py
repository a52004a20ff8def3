"""Pipeline × data parallel at the Program level (no processes): the per-step allreduce pass leaves a pipelined
Program alone, and each stage's optimizer Program averages that stage's summed gradients over its dp group in one
bucket. The numbers are checked on 4 gloo processes in tests/fleet/test_pipeline.py."""
from __future__ import annotations

import torch
from helpers.pipeline import staged_gpt_program

from fleetc.ir.program import OpRole
from fleetc.passes.data_parallel import InsertAllreduce
from fleetc.passes.data_parallel.common import START, WAIT
from fleetc.passes.pipeline_parallel.split import PipelineSplit, pipeline_plan

DP_GROUPS = [[0, 2], [1, 3]]  # the mesh's dp partition for dp=2 × pp=2


def _split(replicas: int):
    program, config = staged_gpt_program(torch.optim.SGD)
    program.metadata["data_parallel"] = {"world_size": replicas, "groups": DP_GROUPS}
    program, allreduce = InsertAllreduce().run(program, config)
    program, _ = PipelineSplit().run(program, config)
    return program, allreduce, pipeline_plan(program)[0]


def test_each_stage_averages_its_gradient_sums_in_one_bucket_per_step():
    program, allreduce, plan = _split(2)
    grads = program.metadata["optimizer"]["grads"]
    assert allreduce.skipped_reason.startswith("pipeline: each stage averages its gradients")
    assert program.metadata["collective_groups"] == {"dp:0": DP_GROUPS}
    assert "over 2 data-parallel replicas" in plan.describe()
    for stage in plan.stages:
        optimizer = stage.phases["optimizer"]
        starts = [op for op in optimizer.global_block.ops if op.type == START]
        waits = [op for op in optimizer.global_block.ops if op.type == WAIT]
        assert len(starts) == len(waits) == 1 and starts[0].args[3] == 0  # one bucket, group dp:0
        averaged = set(waits[0].outputs)
        summed = {key[5:] for phase in ("backward", "backward_weight")
                  for key in stage.phases[phase].fetches if key.startswith("grad:")}
        tied_here = {grads[p] for p, holders in plan.shared.items() if stage.stage in holders}
        assert summed == ({name + "@LOCAL" for name in averaged - tied_here}   # the micro-batch sums travel as @LOCAL
                          | {f"{name}@stage{stage.stage}" for name in tied_here})  # a tied part: summed over stages
        assert summed <= set(optimizer.feeds)
        for phase in ("forward", "backward", "backward_input", "backward_weight"):  # no per-micro-batch allreduce
            assert not [op for op in stage.phases[phase].global_block.ops
                        if op.role & OpRole.COLLECTIVE and not op.type.startswith("fleetc.pipeline_")]
    assert plan.shared
    for param, holders in plan.shared.items():  # a tied gradient: summed over its stages, then averaged
        for s in holders:
            ops = plan.stages[s].phases["optimizer"].global_block.ops
            total = next(i for i, op in enumerate(ops) if op.type == "fleetc.pipeline_shared_sum")
            wait = next(i for i, op in enumerate(ops) if op.type == WAIT)
            assert ops[total].outputs == [grads[param] + "@LOCAL"] and total < wait
            assert grads[param] in ops[wait].outputs


def test_one_replica_adds_no_collective():
    _, _, plan = _split(1)
    for stage in plan.stages:
        assert not [op for op in stage.phases["optimizer"].global_block.ops if op.type == START]
        assert not any(key.endswith("@LOCAL") for phase in stage.phases.values() for key in phase.fetches)
