"""The sharding plan without processes: ownership, the pass as each rank of a group, and the pre-launch estimate."""
from __future__ import annotations

import pytest
from helpers.data_parallel import captured_program, run_data_parallel_passes

from fleetc.cli import main
from fleetc.comm.mesh import ProcessMesh
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.program import VarKind
from fleetc.passes.sharding.estimate import rank_plans
from fleetc.passes.sharding.optimizer_sharding import RS_WAIT
from fleetc.passes.sharding.plan import FlatBucket, ShardedBucket, assign_owners


def test_owners_are_balanced_by_size_and_deterministic():
    sizes = {"a": 10, "b": 7, "c": 3, "d": 3}
    assert assign_owners(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert assign_owners(dict(reversed(sizes.items())), 2) == assign_owners(sizes, 2)
    assert set(assign_owners({"a": 1}, 3).values()) == {0}  # ranks 1 and 2 own nothing


def test_bucket_balance_comes_first_under_stage_2():
    sizes = {"a": 8, "b": 8, "c": 1, "d": 1}
    overall = assign_owners(sizes, 2)
    by_bucket = assign_owners(sizes, 2, [["a", "c"], ["b", "d"]])
    assert overall == {"a": 0, "b": 1, "c": 0, "d": 1}  # bucket [a, c] all on rank 0: its buffer is 2 × 9
    assert ShardedBucket.of(["a", "c"], overall, sizes, 2).padding(2) == 9
    assert ShardedBucket.of(["a", "c"], by_bucket, sizes, 2).padding(2) == 7
    assert by_bucket == {"a": 0, "c": 1, "b": 1, "d": 0}  # each bucket split across both ranks, loads even


def test_flat_buckets_split_evenly_and_every_element_has_one_rank():
    sizes = {"a": 5, "b": 2, "c": 4}
    bucket = FlatBucket.of(["a", "b", "c"], sizes, 3)
    assert (bucket.segment, bucket.starts, bucket.padding(3)) == (4, [0, 5, 7], 1)
    assert bucket.pieces(0) == [("a", 0, 4)]
    assert bucket.pieces(1) == [("a", 4, 5), ("b", 0, 2), ("c", 0, 1)]
    assert bucket.pieces(2) == [("c", 1, 4)]
    for degree in (2, 3, 5, 16):  # 16 > 11 elements: some ranks' segments are all padding and get no piece
        flat = FlatBucket.of(["a", "b", "c"], sizes, degree)
        covered = {name: [] for name in sizes}
        for rank in range(degree):
            pieces = flat.pieces(rank)
            assert sum(hi - lo for _, lo, hi in pieces) <= flat.segment
            for name, lo, hi in pieces:
                covered[name] += range(lo, hi)
        assert all(covered[name] == list(range(size)) for name, size in sizes.items())
        assert flat.segment * degree - 11 < degree
    assert FlatBucket.of(["a", "b", "c"], sizes, 16).pieces(15) == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_rank_of_a_group_runs_the_pass_and_the_estimate_agrees(stage):
    """Each of 4 ranks' Programs updates exactly the parameters the estimate gives it, holds that optimizer
    state and those parameters (stage 3: its flat pieces), and (stages 2, 3) keeps that many gradient bytes; every
    parameter has one owner."""
    program = captured_program("gpt")
    unsharded, _ = run_data_parallel_passes(program, 4)
    plans = rank_plans(unsharded, 4, stage)
    owned = []
    for rank in range(4):
        stamped = program.clone()
        stamped.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=4), rank)
        final, history = run_data_parallel_passes(stamped, 4, sharding=True,
                                                  sharding_configs={"stage": stage, "sharding_degree": 4})
        owned += final.metadata["sharding"]["owned"]
        assert len(final.metadata["sharding"]["owned"]) == plans[rank].owned_params
        state = sum(v.nbytes() for v in final.persistables() if v.kind is VarKind.OPTIMIZER_STATE)
        assert state == plans[rank].optimizer_state_bytes
        params = sum(v.nbytes() for v in final.persistables() if v.kind is VarKind.PARAM)
        assert params == plans[rank].parameter_bytes  # stage 3: only its pieces of the parameters
        if stage >= 2:
            shards = [final.var(op.outputs[0]).nbytes() for _, op in final.walk_ops() if op.type == RS_WAIT]
            assert sum(shards) == plans[rank].gradient_bytes
        assert "sharding" in [r.name for r in history]
    if stage >= 2:  # flat buckets split evenly: a parameter may be updated in pieces by several ranks
        assert set(owned) == set(unsharded.metadata["optimizer"]["grads"]) and len(owned) > len(set(owned))
    else:
        assert sorted(owned) == sorted(unsharded.metadata["optimizer"]["grads"])


def test_shard_plan_prints_every_rank_for_a_world_this_machine_cannot_run(capsys):
    assert main(["shard-plan", "cli_factories:gpt_sharded", "--world-size", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("process mesh dp=1 × pp=1 × sharding=64 × mp=1 (64 ranks); sharding stage 2")
    assert len([line for line in out if line.split()[0].isdigit()]) == 64
    assert main(["shard-plan", "cli_factories:mlp", "--world-size", "2"]) == 2  # sharding off: one-line error
