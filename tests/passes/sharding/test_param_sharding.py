"""Stage 3 as a Program rewrite, without processes: the zoo GPT through the passes as each rank of a group."""
from __future__ import annotations

import math

import pytest
from helpers.data_parallel import captured_program, run_data_parallel_passes

from fleetc.comm.mesh import ProcessMesh
from fleetc.comm.plan import collective_plan
from fleetc.errors import StrategyError
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.liveness import block_reads
from fleetc.ir.printer import format_program
from fleetc.ir.program import OpRole, VarKind
from fleetc.passes.sharding.param_sharding import (
    GATHER_START,
    GATHER_WAIT,
    GATHERED_VIEWS,
)


@pytest.mark.parametrize("layout", ["flat", "whole"])
@pytest.mark.parametrize("segment_mb", [32.0, 0.01])
def test_every_rank_gathers_alike_and_reads_only_what_it_holds_or_gathered(segment_mb, layout):
    """Flat (the default): a rank holds a flat piece of each parameter bucket, so a parameter's Var here is its piece
    (or whole, where its piece is all of it); whole (the layout stamped after a whole-parameter training step): the
    parameters it owns."""
    program = captured_program("gpt")
    params = {v.name: v.shape for v in program.persistables() if v.kind is VarKind.PARAM}
    plans, held = [], []
    for rank in range(2):
        stamped = program.clone()
        stamped.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), rank)
        if layout == "whole":
            stamped.metadata["sharding"]["param_layout"] = "whole"
        final, history = run_data_parallel_passes(
            stamped, 2, sharding=True, sharding_configs={"stage": 3, "sharding_degree": 2,
                                                         "segment_broadcast_MB": segment_mb})
        meta = final.metadata["sharding"]
        assert meta["param_layout"] == layout
        if layout == "whole":
            assert set(meta["param_owners"]) == params.keys()
            mine = local = {p for p, owner in meta["param_owners"].items() if owner == rank}
        else:
            mine = set(meta["param_pieces"])
            local = {p for p, (lo, hi) in meta["param_pieces"].items() if hi - lo == math.prod(params[p])}
            for p in mine - local:  # the Var of a parameter this rank holds part of is that flat piece
                lo, hi = meta["param_pieces"][p]
                assert final.var(p).shape == (hi - lo,)
        kept = {v.name for v in final.persistables() if v.kind is VarKind.PARAM}
        assert kept == mine  # a parameter this rank holds nothing of has no Var here
        reads = {name for _, op in final.walk_ops() if op.type != GATHER_START and OpRole.OPTIMIZE not in op.role
                 for name in block_reads(final, op)}
        assert not (params.keys() - local) & reads  # the forward and backward read gathered copies
        ops = final.global_block.ops
        first_backward = next(i for i, op in enumerate(ops) if OpRole.BACKWARD in op.role)
        gathered = [op for op in ops if op.type == GATHERED_VIEWS]
        forward = {name for op in gathered if ops.index(op) < first_backward for name in op.outputs}
        backward = {name for op in gathered if ops.index(op) > first_backward for name in op.outputs}
        # every foreign parameter is gathered for the forward; the backward gathers again (no forward buffer
        # survives into it): the weights the backward's matmuls need
        assert {n.removesuffix("@FULL") for n in forward} == params.keys() - local
        assert backward and all(n.endswith("@FULL_BW") for n in backward)
        assert not forward & {n for op in ops[first_backward:] for n in block_reads(final, op)}
        starts = [i for i, op in enumerate(ops) if op.type == GATHER_START]
        waits = [i for i, op in enumerate(ops) if op.type == GATHER_WAIT]
        assert len(starts) == len(waits) == history["sharding"].report.stats["param_gather_buckets"]
        # the backward's first bucket is prefetched: issued right after the forward's last bucket arrived, so it is
        # in flight during the end of the forward and the loss (compute between its issue and its wait), and it is
        # there in the printed Program (dump-ir) before the first backward op
        wait_of = {ops[w].args[0].name: w for w in waits}  # a start's work Var → the index of its wait
        first_bw_start = min(i for i in starts if wait_of[ops[i].outputs[0]] > first_backward)
        first_bw_wait = wait_of[ops[first_bw_start].outputs[0]]
        assert first_bw_start < first_backward < first_bw_wait
        assert first_bw_start > max(w for w in waits if w < first_backward)
        assert any(OpRole.FORWARD in op.role and OpRole.COLLECTIVE not in op.role
                   for op in ops[first_bw_start:first_backward])
        text = format_program(final)
        assert text.index(ops[first_bw_start].name) < text.index(ops[first_backward].name)
        if segment_mb < 1:  # many buckets: each issued after the previous bucket's wait and before its own
            assert len(starts) > 4
            assert all(waits[i] < starts[i + 1] < waits[i + 1] for i in range(len(starts) - 1))
            # ... and within a phase with compute between issue and wait: the gather overlaps it
            assert any(OpRole.COLLECTIVE not in op.role for op in ops[starts[1]:waits[1]])
        plans.append(collective_plan(final))
        held.append(mine)
    assert plans[0] == plans[1]  # the same collectives in the same order: nothing to deadlock on
    assert held[0] | held[1] == params.keys()
    if layout == "whole":
        assert held[0].isdisjoint(held[1])


def test_a_program_that_does_not_fit_the_training_steps_flat_layout_is_refused_by_name():
    """A later Program of the model follows the layout the training step stamped; one whose parameters differ (here
    the stamp names a parameter this Program lacks) is a clear error, not a wrong gather."""
    program = captured_program("mlp")
    program.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), 0)
    names = [v.name for v in program.persistables() if v.kind is VarKind.PARAM]
    program.metadata["sharding"].update(param_layout="flat", param_buckets=[[*names, "head.weight"]])
    with pytest.raises(StrategyError, match="'head.weight' is in only one of them"):
        run_data_parallel_passes(program, 2, sharding=True, sharding_configs={"stage": 3, "sharding_degree": 2})
