"""`sharding_configs.segment_broadcast_MB` sizes the gather buckets: the zoo mlp through the passes as rank 0 of 2.

Stage 1 gathers the updated parameters in buckets of at most that size (a parameter larger than it alone), stage 3
lays the parameters out in flat buckets of that size; stage 2 on flat buckets gathers through its gradient buckets'
layout, so the Program does not change and the report says why.
"""
from __future__ import annotations

import pytest
from helpers.data_parallel import captured_program, run_data_parallel_passes

from fleetc.comm.mesh import ProcessMesh
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.printer import format_program
from fleetc.passes.data_parallel.bucketing import MB
from fleetc.passes.sharding.optimizer_sharding import GATHER
from fleetc.passes.sharding.param_sharding import GATHER_START

SMALL_MB = 0.005  # 5,243 bytes: the mlp's 8 and 16 KB weights each alone, the small parameters together


def sharded(stage: int, segment_mb: float):
    program = captured_program("mlp").clone()
    program.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), 0)
    return run_data_parallel_passes(program, 2, sharding=True, sharding_configs={
        "stage": stage, "sharding_degree": 2, "segment_broadcast_MB": segment_mb})


def gathers(program, kind: str) -> list[list[str]]:
    """The parameters of each gather of `kind`, in Program order."""
    return [[ref.name for ref in op.args[0]] for _, op in program.walk_ops() if op.type == kind]


@pytest.mark.parametrize("stage, kind", [(1, GATHER), (3, GATHER_START)])
def test_smaller_segments_give_more_gather_buckets_each_within_the_size(stage, kind):
    default, _ = sharded(stage, 32.0)
    small, history = sharded(stage, SMALL_MB)
    buckets, default_buckets = gathers(small, kind), gathers(default, kind)
    assert len(buckets) > len(default_buckets) >= 1
    if stage == 1:  # the same parameters, cut finer (stage 3 gathers what this rank does not hold whole, which
        # depends on the layout)
        assert sorted(n for b in buckets for n in b) == sorted(n for b in default_buckets for n in b)
    sizes = {v.name: v.nbytes() for v in captured_program("mlp").persistables()}
    for bucket in buckets:
        total = sum(sizes[name.split("@")[0]] for name in bucket)
        assert total <= SMALL_MB * MB or len(bucket) == 1, (bucket, total)
    assert not any("segment_broadcast_MB" in note for note in history["sharding"].report.notes)


def test_stage_2_on_flat_buckets_reports_why_the_segment_size_does_not_apply():
    default, _ = sharded(2, 32.0)
    small, history = sharded(2, SMALL_MB)
    assert format_program(small) == format_program(default)
    notes = history["sharding"].report.notes
    assert any(note.startswith(f"sharding_configs.segment_broadcast_MB={SMALL_MB} not applied: stage 2 on flat "
                               "buckets") for note in notes), notes
