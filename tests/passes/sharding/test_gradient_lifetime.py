"""Stage 2: no full-size gradient outlives its bucket. The zoo mlp through the passes as each rank of 2.

A bucket's local gradients are read by nothing after the reduce-scatter that packs them (so the runtime frees them
there), the padded buffer lives only between that start and its wait, and what the update reads are views of the
rank's shard.
"""
from __future__ import annotations

import pytest
from helpers.data_parallel import captured_program, run_data_parallel_passes

from fleetc.comm.mesh import ProcessMesh
from fleetc.fleet.trainer import sharding_metadata
from fleetc.ir.liveness import block_reads
from fleetc.ir.program import OpRole
from fleetc.passes.sharding.optimizer_sharding import RS_START, RS_WAIT


@pytest.mark.parametrize("rank", [0, 1])
def test_local_gradients_die_at_their_reduce_scatter(rank):
    program = captured_program("mlp").clone()
    program.metadata["sharding"] = sharding_metadata(ProcessMesh(sharding=2), rank)
    final, _ = run_data_parallel_passes(program, 2, sharding=True, sharding_configs={"stage": 2, "sharding_degree": 2},
                                        fuse_all_reduce_ops=False)  # a bucket per gradient
    ops = final.global_block.ops
    starts = [i for i, op in enumerate(ops) if op.type == RS_START]
    assert len(starts) > 1
    packed = set()
    for i in starts:
        local = {ref.name for ref in ops[i].args[0]}
        packed |= local
        assert all(name.endswith("@GRAD@LOCAL") for name in local), local
        later = {name for op in ops[i + 1:] for name in block_reads(final, op)}
        assert not local & later, sorted(local & later)  # nothing reads a full-size gradient after its bucket
        work = ops[i].outputs[0]
        readers = [op for op in ops if work in block_reads(final, op)]
        assert [op.type for op in readers] == [RS_WAIT]  # the padded buffer lives only inside the collective
    grads = set(final.metadata["optimizer"]["grads"].values())
    assert {name.removesuffix("@LOCAL") for name in packed} == grads  # every gradient went through a bucket
    updates = [op for op in ops if OpRole.OPTIMIZE in op.role]
    shards = {op.outputs[0] for op in ops if op.type == RS_WAIT}
    whole = sum(final.var(g + "@LOCAL").nbytes() for g in grads)
    # this rank's half, and each bucket padded by fewer than 2 elements
    assert updates and sum(final.var(name).nbytes() for name in shards) <= whole // 2 + 4 * len(starts)
