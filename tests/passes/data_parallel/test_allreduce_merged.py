"""Gradient merge under data parallel: merged gradients are allreduced once per k steps, inside the update block."""
from __future__ import annotations

import pytest
import torch
from helpers.data_parallel import (  # noqa: F401  (a fixture)
    _Done,
    captured_program,
    one_rank_transport,
    run_data_parallel_passes,
    simulated_rank,
)
from zoo import ZOO

import fleetc
from fleetc.comm import collectives
from fleetc.comm.plan import collective_plan
from fleetc.ir.program import OpRole, Program
from fleetc.ir.registry import resolve_callable
from fleetc.passes.data_parallel.allreduce import START
from fleetc.passes.data_parallel.merged import WAIT_INTO

MERGE = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}


@pytest.fixture(scope="module")
def programs() -> dict[str, Program]:
    return {name: captured_program(name) for name in ("mlp", "cnn")}


def _collectives(program: Program) -> list[tuple[int, str]]:
    return [(block.idx, op.type) for block, op in program.walk_ops() if OpRole.COLLECTIVE in op.role]


def _update_block(program: Program):
    return program.blocks[program.metadata["gradient_merge"]["update_block"]]


@pytest.mark.parametrize("fields, buckets", [({"fuse_all_reduce_ops": False}, 6), ({}, 1)])
def test_collectives_only_in_the_update_block_before_the_averaging(programs, fields, buckets):
    program, history = run_data_parallel_passes(programs["mlp"], **MERGE, **fields)
    update = _update_block(program)
    assert {idx for idx, _ in _collectives(program)} == {update.idx}  # none in the per-step ops
    types = [op.type for op in update.ops]
    assert types.count(START) == buckets and types.count(WAIT_INTO) == buckets
    last_wait = max(i for i, t in enumerate(types) if t == WAIT_INTO)
    assert last_wait < types.index("fleetc.divide") < types.index("fleetc.sgd")
    allreduced = [r.name for op in update.ops if op.type == START for r in op.args[1]]
    assert sorted(allreduced) == sorted(program.metadata["gradient_merge"]["accumulators"].values())
    # each per-step gradient is accumulated as computed, this rank's own, without waiting for a collective
    assert all(op.args[1].name.endswith("@GRAD") for op in program.global_block.ops if op.type == "fleetc.accumulate")
    assert len(collective_plan(program)) == 3 * buckets  # the plan-hash check covers the update block
    report = history["fuse_all_reduce_ops" if buckets == 1 else "insert_allreduce"].report
    assert report.stats["collectives_per_k_steps"] == buckets
    assert report.notes[0] == (f"gradient merge: the merged gradients are allreduced in the update block, before the "
                               f"averaging and update: {buckets} collective(s) every 2 steps")
    assert history["allreduce_views"].report.skipped_reason.startswith("gradient merge: the gradients are allreduced")


def test_amp_merges_fp32_casts_of_weight_gradients_and_they_are_allreduced_in_the_update_block(programs):
    program, history = run_data_parallel_passes(programs["mlp"], amp=True, **MERGE)
    update = _update_block(program)
    assert {idx for idx, _ in _collectives(program)} == {update.idx}
    (start,) = [op for op in update.ops if op.type == START]
    assert [r.name for r in start.args[1]][:2] == ["out.weight@GRAD@FP32@MERGE", "out.bias@GRAD@MERGE"]
    assert len(start.args[1]) == 6 and history["fuse_all_reduce_ops"].report.stats["collectives_per_k_steps"] == 1


def test_buckets_follow_the_plain_strategy_fields(programs):
    program, history = run_data_parallel_passes(programs["cnn"], **MERGE, fuse_grad_size_in_TFLOPS=4, nccl_comm_num=2,
                            sync_nccl_allreduce=False)
    starts = [op for op in _update_block(program).ops if op.type == START]
    assert [len(s.args[1]) for s in starts] == [4, 4, 4, 4, 1]  # 17 gradients, at most 4 per bucket
    assert [s.args[3] for s in starts] == [0, 1, 0, 1, 0]  # communicators round-robin
    assert [r.name for r in starts[0].args[1][:2]] == ["head.weight@GRAD@MERGE", "head.bias@GRAD@MERGE"]
    assert history["fuse_all_reduce_ops"].report.stats == {"buckets": 5, "gradients": 17, "allreduces_before": 17,
                                                           "collectives_per_k_steps": 5}
    assert history["overlap_allreduce"].report.skipped_reason.startswith("gradient merge")
    program, _ = run_data_parallel_passes(programs["mlp"], world=4, **MERGE, use_hierarchical_allreduce=True,
                      hierarchical_allreduce_inter_nranks=2)
    assert [op.args[4] for op in _update_block(program).ops if op.type == START] == ["hierarchical"]


def test_two_rank_program_trains_like_eager_gradient_merge_and_communicates_every_k_steps(one_rank_transport):
    entry = ZOO["mlp"]
    strategy = fleetc.DistributedStrategy()
    strategy.gradient_merge, strategy.gradient_merge_configs = True, {"k_steps": 2}
    strategy.fuse_grad_size_in_TFLOPS = 4  # two buckets
    eager, eager_opt, trainer = simulated_rank("mlp", "adamw", strategy)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        (x, y), _ = entry.make_batch(g)
        if step % 2 == 0:
            eager_opt.zero_grad(set_to_none=True)
        loss = entry.loss_fn(eager(x), y)
        (loss / 2).backward()
        if step % 2 == 1:
            eager_opt.step()
        torch.testing.assert_close(trainer.step(x, y), loss.detach(), rtol=1e-5, atol=1e-6)
        assert len(one_rank_transport) == 2 * ((step + 1) // 2)  # two buckets, issued in update steps only
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for flat, accumulators, in_place in one_rank_transport:  # the buffer is a copy of the accumulators
        assert not any(in_place)
        assert all(a.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() for a in accumulators)


def test_wait_into_copies_the_averaged_buffer_back_into_the_accumulators():
    accumulators = [torch.zeros(2, 2), torch.zeros(3)]
    flat = torch.arange(7.0)  # what the allreduce left in the buffer
    pending = collectives.PendingAllreduce(_Done(), "merged_bucket0", collectives.FLAT, "0")
    resolve_callable(WAIT_INTO)(flat, pending, accumulators)
    assert accumulators[0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and accumulators[1].tolist() == [4.0, 5.0, 6.0]
