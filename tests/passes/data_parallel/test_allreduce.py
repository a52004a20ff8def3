"""Allreduce insertion, fusion and overlap on captured zoo Programs stamped as 2-rank data parallel (no processes)."""
from __future__ import annotations

import pytest
import torch
from helpers.data_parallel import captured_program, run_data_parallel_passes

import fleetc

from fleetc.errors import PassError
from fleetc.ir.program import OpRole, Program
from fleetc.passes.data_parallel.allreduce import START, WAIT, gradient_vars
from fleetc.passes.data_parallel.bucketing import MB, plan_buckets


@pytest.fixture(scope="module")
def programs() -> dict[str, Program]:
    return {name: captured_program(name) for name in ("mlp", "cnn")}


def _types(program: Program) -> list[str]:
    return [op.type for op in program.global_block.ops]


def test_every_gradient_gets_an_allreduce_right_after_its_producer(programs):
    program, history = run_data_parallel_passes(programs["mlp"], fuse_all_reduce_ops=False)
    grads = gradient_vars(programs["mlp"])
    assert len(grads) == 6 and _types(program).count(START) == 6 and _types(program).count(WAIT) == 6
    ops = program.global_block.ops
    for i, op in enumerate(ops):
        if op.type == START:
            local = op.args[1][0].name
            assert ops[i - 1].outputs.count(local) == 1, "the start follows the gradient's producer"
            assert ops[i + 1].type == WAIT and ops[i + 1].outputs == [local.removesuffix("@LOCAL")]
            assert op.role == OpRole.COLLECTIVE and op.attrs["provenance"] == "insert_allreduce"
    assert history["insert_allreduce"].report.stats == {"allreduces": 6}
    assert history["fuse_all_reduce_ops"].report.skipped_reason.startswith("fuse_all_reduce_ops is off")
    assert history["overlap_allreduce"].report.skipped_reason.startswith("sync_nccl_allreduce is on")
    optimizer_reads = {n for op in ops if OpRole.OPTIMIZE in op.role for n in op.inputs}
    assert set(grads) <= optimizer_reads  # the optimizer reads the averaged gradients, under their own names


def test_fusion_buckets_by_count_in_production_order(programs):
    program, history = run_data_parallel_passes(programs["cnn"], fuse_grad_size_in_TFLOPS=4, nccl_comm_num=2)
    starts = [op for op in program.global_block.ops if op.type == START]
    assert len(starts) == 5 and _types(program).count(WAIT) == 5  # 17 gradients, at most 4 per bucket
    assert [len(s.args[1]) for s in starts] == [4, 4, 4, 4, 1]
    assert [s.args[3] for s in starts] == [0, 1, 0, 1, 0]  # communicators round-robin
    first = [ref.name for ref in starts[0].args[1]]
    assert first[:2] == ["head.weight@GRAD@LOCAL", "head.bias@GRAD@LOCAL"]  # backward produces the head first
    # one op read a gradient before its bucket was issued (a dead `aten.t` of head.weight's, DCE drops it)
    assert history["fuse_all_reduce_ops"].report.stats == {"allreduces_before": 17, "buckets": 5, "gradients": 17,
                                                           "ops_deferred": 1}
    flat = program.var(starts[0].args[0].name)
    assert flat.shape == (sum(program.var(r.name).nbytes() for r in starts[0].args[1]) // 4,)


def test_first_bucket_is_small_and_size_cap_closes_buckets(programs):
    program, _ = run_data_parallel_passes(programs["mlp"], last_comm_group_size_MB=0.001, fuse_grad_size_in_MB=1)
    sizes = [[r.name for r in op.args[1]] for op in program.global_block.ops if op.type == START]
    # the first bucket closes at ~1 KB (out.weight alone is 2.5 KB): out.weight, then everything else in 1 MB
    assert sizes == [["out.weight@GRAD@LOCAL"], ["out.bias@GRAD@LOCAL", "fc2.weight@GRAD@LOCAL",
                                                 "fc2.bias@GRAD@LOCAL", "fc1.weight@GRAD@LOCAL",
                                                 "fc1.bias@GRAD@LOCAL"]]


def test_buckets_are_grouped_by_dtype_with_a_small_first_bucket_each():
    grads = [("a", "float32", 100), ("b", "float16", 50), ("c", "float32", 100), ("d", "float16", 50),
             ("e", "float32", 100)]
    buckets = plan_buckets(grads, cap_bytes=250, first_cap_bytes=100, max_grads=50)
    assert [(b.dtype, b.grads) for b in buckets] == [
        ("float32", ["a"]), ("float16", ["b", "d"]), ("float32", ["c", "e"])]
    assert [b.grads for b in plan_buckets(grads, 1 * MB, 1 * MB, 2)] == [["a", "c"], ["b", "d"], ["e"]]


def test_overlap_waits_just_before_the_first_consumer(programs):
    program, history = run_data_parallel_passes(programs["cnn"], sync_nccl_allreduce=False, fuse_grad_size_in_TFLOPS=4)
    ops = program.global_block.ops
    for i, op in enumerate(ops):
        if op.type == WAIT:
            start = next(j for j, s in enumerate(ops) if s.type == START and s.outputs[0] == op.args[1].name)
            assert start < i
            assert set(op.outputs) & set(ops[i + 1].inputs) or ops[i + 1].type == WAIT
            assert not any(set(op.outputs) & set(o.inputs) for o in ops[start + 1:i])
    first_wait = next(i for i, op in enumerate(ops) if op.type == WAIT)
    last_backward = max(i for i, op in enumerate(ops) if OpRole.BACKWARD in op.role)
    assert first_wait > last_backward  # all of backward runs while the buckets are in flight
    assert history["overlap_allreduce"].report.stats == {"waits_moved": 5}


def test_single_process_programs_are_left_alone(programs):
    program, history = run_data_parallel_passes(programs["mlp"], world=1, sync_nccl_allreduce=False)
    assert START not in _types(program)
    for name in ("insert_allreduce", "fuse_all_reduce_ops", "overlap_allreduce"):
        assert history[name].report.skipped_reason == "single process: no collectives needed"
        assert not history[name].report.changed


def test_hierarchical_needs_a_node_size_that_divides_the_world(programs):
    with pytest.raises(PassError, match="hierarchical_allreduce_inter_nranks=3"):
        run_data_parallel_passes(programs["mlp"], world=4, use_hierarchical_allreduce=True, hierarchical_allreduce_inter_nranks=3)
    program, _ = run_data_parallel_passes(programs["mlp"], world=4, use_hierarchical_allreduce=True, hierarchical_allreduce_inter_nranks=2)
    assert {op.args[4] for op in program.global_block.ops if op.type == START} == {"hierarchical"}
    assert program.metadata["collective_groups"] == {"intra:0": [[0, 1], [2, 3]], "inter:0": [[0, 2], [1, 3]]}


def test_sync_batch_norm_replaces_training_batch_norms_and_their_backwards(programs):
    program, history = run_data_parallel_passes(programs["cnn"], sync_batch_norm=True)
    types = _types(program)
    assert types.count("fleetc.sync_batch_norm") == 5 and types.count("fleetc.sync_batch_norm_backward") == 5
    assert "aten._native_batch_norm_legit_functional.default" not in types
    assert all(OpRole.COLLECTIVE in op.role for op in program.global_block.ops if "sync_batch_norm" in op.type)
    assert history["sync_batch_norm"].report.stats == {"batch_norms_synced": 5, "backwards_synced": 5}
    _, single = run_data_parallel_passes(programs["cnn"], world=1, sync_batch_norm=True)
    assert single["sync_batch_norm"].report.skipped_reason == "single process: no collectives needed"
    _, no_bn = run_data_parallel_passes(programs["mlp"], sync_batch_norm=True)
    assert no_bn["sync_batch_norm"].report.skipped_reason == "the Program has no training-mode batch norm"



@pytest.mark.parametrize("fuse", [False, True])
def test_amp_gradients_are_averaged_in_float32(programs, fuse):
    """Under AMP (bf16) a matmul's weight gradient is computed in bf16 and cast to float32 for the optimizer: the
    ranks average the float32 cast, as Paddle and torch DDP do. Averaging the bf16 one lost a bf16 rounding per
    step, and data parallel + AMP then drifted from the same AMP run accumulating the shards in one process."""
    program, _ = run_data_parallel_passes(programs["mlp"], fuse_all_reduce_ops=fuse, amp=True,
                                          amp_configs={"dtype": "bfloat16"})
    starts = [op for op in program.global_block.ops if op.type == START]
    averaged = [ref.name for op in starts for ref in op.args[1]]
    assert len(averaged) == 6 and {program.var(op.args[0].name).dtype for op in starts} == {"float32"}
    assert all(program.var(name).dtype == "float32" for name in averaged)
    casts = [op for op in program.global_block.ops if op.type == "aten._to_copy.default"
             and op.outputs[0].endswith("@GRAD@LOCAL")]
    assert sorted(op.args[0].name for op in casts) == [f"{layer}.weight@GRAD@bfloat16" for layer in ("fc1", "fc2", "out")]


class _SharedGradient(torch.nn.Module):
    """`x + pos` with equal shapes: autograd gives `pos` and `x` one gradient Var, which the backward reads on."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 4, 8))
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.proj(x) + self.pos).mean(1)


@pytest.mark.parametrize("fuse", [False, True])
def test_backward_ops_read_the_rank_local_gradient_not_the_average(fuse):
    """Regression: reading the averaged `pos` gradient gave `proj.weight` the gradient of the averaged upstream
    gradient with the local input, not the average of local gradients (and a cycle in a fused bucket)."""
    torch.manual_seed(0)
    model = _SharedGradient()
    trainer = fleetc.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=torch.nn.functional.cross_entropy)
    trainer.step(torch.randn(1, 4, 8), torch.tensor([1]))
    program, _ = run_data_parallel_passes(trainer.history["remove_noop_views"].program, fuse_all_reduce_ops=fuse)
    backward_readers = [op for op in program.global_block.ops if OpRole.BACKWARD in op.role
                        and {"pos@GRAD", "pos@GRAD@LOCAL"} & set(op.inputs)]
    assert backward_readers, "the backward reads the shared gradient on"
    assert all("pos@GRAD@LOCAL" in op.inputs and "pos@GRAD" not in op.inputs for op in backward_readers)
    optimizer_reads = {n for op in program.global_block.ops if OpRole.OPTIMIZE in op.role for n in op.inputs}
    assert "pos@GRAD" in optimizer_reads  # the update reads the average
