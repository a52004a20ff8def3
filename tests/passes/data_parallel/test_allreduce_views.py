"""Gradient producers write into their bucket's flat buffer: report counts, no-copy proof, fallbacks, out kernels."""
from __future__ import annotations

import pathlib

import pytest
import torch
import torchgen
from conftest import eager_step
from helpers.data_parallel import (  # noqa: F401  (a fixture)
    captured_program,
    one_rank_transport,
    run_data_parallel_passes,
    simulated_rank,
)
from zoo import ZOO

import fleetc
from fleetc.comm import collectives
from fleetc.ir.liveness import view_vars
from fleetc.ir.program import Op, OpRole, Ref, Var
from fleetc.ir.registry import resolve_callable
from fleetc.ir.verifier import verify
from fleetc.passes.data_parallel.allreduce import START
from fleetc.passes.data_parallel.views import OUT_KERNELS, SLOT, AllreduceViews
from fleetc.strategy import resolve_strategy


@pytest.fixture(scope="module")
def programs():
    return {name: captured_program(name) for name in ("mlp", "cnn", "gpt")}


# (in place, copied) per zoo model with the default strategy, and why the copied ones are copied.
EXPECTED = {
    "mlp": (6, 0, []),
    "cnn": (2, 15, ["copied 4 gradient(s) into the buffer: fleetc.fused_bn_act_grad has no out kernel",
                    "copied 5 gradient(s) into the buffer: aten.convolution_backward.default has no out kernel",
                    "copied 6 gradient(s) into the buffer: aten.native_batch_norm_backward.default has no out kernel"]),
    "gpt": (17, 11, ["copied 10 gradient(s) into the buffer: aten.native_layer_norm_backward.default has no out "
                     "kernel", "copied 1 gradient(s) into the buffer: aten.embedding_dense_backward.default has no "
                     "out kernel"]),
}


@pytest.mark.parametrize("zoo_name", sorted(EXPECTED))
def test_report_counts_gradients_written_in_place_and_copied(programs, zoo_name):
    program, history = run_data_parallel_passes(programs[zoo_name])
    report = history["allreduce_views"].report
    in_place, copied, reasons = EXPECTED[zoo_name]
    assert report.stats == {"in_place": in_place, "copied": copied} and report.changed
    assert len(report.notes) == len(reasons)
    for note, reason in zip(sorted(report.notes), sorted(reasons)):
        assert note.startswith(reason), note
    ops = program.global_block.ops
    slots = [op for op in ops if op.type == SLOT]
    assert len(slots) == in_place and all(op.attrs["provenance"] == "allreduce_views" for op in slots)
    writers = [op for op in ops if any(k in op.kwargs for k in ("out", "grad_input"))]
    assert len(writers) == in_place
    # liveness sees what an out= overload returns as its `out` argument: no new bytes in the memory estimate
    assert {n for op in writers for n in op.defined} <= view_vars(program.global_block)
    for start in (op for op in ops if op.type == START):
        flat = start.args[0].name
        allocated = next(i for i, op in enumerate(ops) if op.outputs == [flat])
        assert all(allocated < i for i, op in enumerate(ops) if op.type == SLOT and op.args[0].name == flat)
        assert len(start.args[2]) == len(start.args[1])


def test_single_process_and_unfused_programs(programs):
    _, single = run_data_parallel_passes(programs["mlp"], world=1)
    assert single["allreduce_views"].report.skipped_reason == "single process: no collectives needed"
    program, unfused = run_data_parallel_passes(programs["mlp"], fuse_all_reduce_ops=False)
    assert unfused["allreduce_views"].report.stats == {"in_place": 6, "copied": 0}  # one buffer per gradient
    assert [op.args[2] for op in program.global_block.ops if op.type == START] == [[True]] * 6


@pytest.mark.parametrize("zoo_name", ["mlp", "cnn", pytest.param("gpt", marks=pytest.mark.slow)])
def test_gradients_live_in_the_bucket_buffer_and_training_matches_eager(one_rank_transport, zoo_name):
    entry = ZOO[zoo_name]
    strategy = fleetc.DistributedStrategy()
    strategy.fuse_grad_size_in_TFLOPS = 4  # several buckets
    eager, eager_opt, trainer = simulated_rank(zoo_name, "momentum", strategy)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        args, kwargs = entry.make_batch(g)
        torch.manual_seed(100 + step)
        want = eager_step(eager, eager_opt, entry.loss_fn, args, kwargs)
        torch.manual_seed(100 + step)
        torch.testing.assert_close(trainer.step(*args, **kwargs), want, rtol=1e-5, atol=1e-6)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    stats = trainer.report().stats["allreduce_views"]
    assert stats["in_place"] == EXPECTED[zoo_name][0]
    starts_per_step = sum(op.type == START for _, op in trainer.program.walk_ops())
    assert starts_per_step > 1 and len(one_rank_transport) == 2 * starts_per_step
    written = 0
    for flat, grads, in_place in one_rank_transport:
        offset = 0
        for grad, flag in zip(grads, in_place):
            if flag:  # the producer's result is the buffer's storage, at the gradient's slot: no copy was made
                assert grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                assert grad.data_ptr() == flat.data_ptr() + offset * flat.element_size()
                written += 1
            else:
                assert grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
            offset += grad.numel()
        assert offset == flat.numel()
    assert written == 2 * stats["in_place"]


def test_fill_bucket_copies_the_rest_and_refuses_a_gradient_outside_its_slot():
    flat = torch.zeros(5)
    in_slot = flat[:2].view(2)
    in_slot.copy_(torch.tensor([1.0, 2.0]))
    collectives.fill_bucket(flat, [in_slot, torch.tensor([[3.0, 4.0, 5.0]])], [True, False], "b")
    assert flat.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(RuntimeError, match="gradient 1 of the bucket .* slot at element 2 .* lives elsewhere"):
        collectives.fill_bucket(flat, [in_slot, torch.ones(3)], [True, True], "b")


def _fused_mlp(programs):
    """The 2-rank mlp Program right before allreduce_views, and its strategy config."""
    _, history = run_data_parallel_passes(programs["mlp"])
    return history["fuse_all_reduce_ops"].program.clone(), resolve_strategy(fleetc.DistributedStrategy())


def test_a_gradient_read_after_its_allreduce_is_issued_is_copied(programs):
    program, config = _fused_mlp(programs)
    block = program.global_block
    start = next(i for i, op in enumerate(block.ops) if op.type == START)
    block.add_var(Var("late_read", (10, 64), "float32"))
    block.ops.insert(start + 1, Op("late", "aten.clone.default", (Ref("out.weight@GRAD@LOCAL"),), {}, ["late_read"],
                                   {"op_role": int(OpRole.BACKWARD)}))
    program, report = AllreduceViews().run(program, config)
    assert report.stats == {"in_place": 5, "copied": 1}
    assert report.notes == ["copied 1 gradient(s) into the buffer: the gradient or a value it views is read after "
                            "its bucket's allreduce is issued (out.weight)"]
    verify(program, after_pass="allreduce_views")


def test_a_transposed_gradient_is_written_through_its_transpose(programs):
    """`w@GRAD = t(mm(b.t(), a.t()))`: mm writes a transposed view of the slot, so the gradient is the slot."""
    program, config = _fused_mlp(programs)
    block = program.global_block
    i, mm = next((i, op) for i, op in enumerate(block.ops) if op.outputs == ["out.weight@GRAD@LOCAL"])
    a, b = mm.args
    for name, shape in (("a_t", (64, 16)), ("b_t", (16, 10)), ("product_t", (64, 10))):
        block.add_var(Var(name, shape, "float32"))
    role = {"op_role": int(OpRole.BACKWARD)}
    block.ops[i:i + 1] = [Op("a_t_op", "aten.t.default", (b,), {}, ["a_t"], dict(role)),
                          Op("b_t_op", "aten.t.default", (a,), {}, ["b_t"], dict(role)),
                          Op("product_t_op", "aten.mm.default", (Ref("a_t"), Ref("b_t")), {}, ["product_t"],
                             dict(role)),
                          Op("grad_t_op", "aten.t.default", (Ref("product_t"),), {}, ["out.weight@GRAD@LOCAL"],
                             dict(role))]
    program, report = AllreduceViews().run(program, config)
    assert report.stats == {"in_place": 6, "copied": 0}
    verify(program, after_pass="allreduce_views")
    slot = next(op for op in program.global_block.ops if op.type == SLOT and "out.weight" in op.outputs[0])
    assert slot.args[1:] == ([64, 10], [1, 64], 0)  # the mm's [64, 10] result, transposed into the [10, 64] slot
    flat = torch.full((6922,), float("nan"))
    x, y = torch.randn(10, 16), torch.randn(16, 64)
    view = resolve_callable(SLOT)(flat, *slot.args[1:])
    product = resolve_callable("aten.mm.out")(y.t(), x.t(), out=view)
    grad = product.t()
    torch.testing.assert_close(grad, x @ y)
    assert grad.is_contiguous() and grad.data_ptr() == flat.data_ptr() and flat[640:].isnan().all()


def _native_functions() -> str:
    return (pathlib.Path(torchgen.__file__).parent / "packaged/ATen/native/native_functions.yaml").read_text()


@pytest.mark.parametrize("functional", sorted(OUT_KERNELS))
def test_out_overloads_are_structured_kernels_that_write_directly(functional):
    """An autogenerated out= overload computes then copies; only structured kernels write into `out` itself."""
    out_type, keyword = OUT_KERNELS[functional]
    name = out_type.removeprefix("aten.")
    entry = _native_functions().split(f"\n- func: {name}(", 1)[1].split("\n- func:", 1)[0]
    assert "structured: True" in entry, f"{out_type} is not a structured kernel"
    schema = resolve_callable(out_type)._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert [(a.name, a.kwarg_only) for a in written] == [(keyword, True)]
    functional_args = [a.name for a in resolve_callable(functional)._schema.arguments]
    assert [a.name for a in schema.arguments if a.name != keyword] == functional_args
