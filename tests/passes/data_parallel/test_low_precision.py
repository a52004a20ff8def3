"""use_pure_fp16 × data parallel: a low-precision parameter's gradient is averaged in its own dtype (as Paddle and
torch DDP communicate it) and the float32 cast the master update reads is taken after the average
(fleetc/passes/data_parallel/low_precision.py). tests/fleet/test_sharding_stage3_flat.py trains it on 2 ranks
against eager use_pure_fp16 and the sharded stages."""
from __future__ import annotations

import pytest
from helpers.data_parallel import captured_program, run_data_parallel_passes

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import OpRole, Program
from fleetc.passes.data_parallel.allreduce import START, WAIT

PARAMS = [f"{layer}.{kind}" for layer in ("fc1", "fc2", "out") for kind in ("weight", "bias")]


@pytest.fixture(scope="module")
def mlp() -> Program:
    return captured_program("mlp")


def pure(dtype: str, **amp) -> dict:
    return {"amp": True, "amp_configs": {"use_pure_fp16": True, "use_fp16_guard": False, "dtype": dtype, **amp}}


@pytest.mark.parametrize("dtype, amp", [("bfloat16", {}),
                                        ("float16", {"use_dynamic_loss_scaling": True, "init_loss_scaling": 1024.0})])
@pytest.mark.parametrize("fuse", [False, True])
def test_pure_low_precision_gradients_are_averaged_in_their_dtype_and_cast_after(mlp, dtype, amp, fuse):
    """Every gradient (the biases' too, whose reduction accumulates in float32: rounded to the parameter's dtype
    before the average) is averaged in the parameters' dtype; each float32 cast the update section reads is of the
    averaged gradient, defined after the wait, and AMP's overflow check and unscaling read those casts."""
    program, _ = run_data_parallel_passes(mlp, fuse_all_reduce_ops=fuse, **pure(dtype, **amp))
    block = program.global_block
    starts = [op for op in block.ops if op.type == START]
    assert {program.var(op.args[0].name).dtype for op in starts} == {dtype}
    assert sorted(ref.name for op in starts for ref in op.args[1]) == sorted(f"{p}@GRAD@LOCAL" for p in PARAMS)
    waited = {name: i for i, op in enumerate(block.ops) if op.type == WAIT for name in op.outputs}
    casts = {op.args[0].name: (i, op) for i, op in enumerate(block.ops)
             if op.type == "aten._to_copy.default" and op.args[0].name in waited}
    assert sorted(casts) == sorted(f"{p}@GRAD" for p in PARAMS)
    for grad, (index, cast) in casts.items():
        assert program.var(grad).dtype == dtype and program.var(cast.outputs[0]).dtype == "float32"
        assert index > waited[grad] and OpRole.OPTIMIZE in cast.role and OpRole.BACKWARD not in cast.role
    check = next(op for op in block.ops if op.type == "fleetc.check_finite_and_unscale")
    assert sorted(ref.name for ref in check.args[0]) == sorted(op.outputs[0] for _, op in casts.values())
    local = [op for op in block.ops if OpRole.BACKWARD in op.role
             and {f"{p}@GRAD" for p in PARAMS}.intersection(block_reads(program, op))]
    assert not local, [op.name for op in local]  # backward reads only the rank's own gradients


def test_amp_o1_still_averages_the_float32_casts(mlp):
    """Float32 parameters (AMP O1): what is averaged is the float32 cast, as before."""
    program, _ = run_data_parallel_passes(mlp, amp=True, amp_configs={"dtype": "bfloat16"})
    starts = [op for op in program.global_block.ops if op.type == START]
    assert {program.var(op.args[0].name).dtype for op in starts} == {"float32"}


def test_fp16_allreduce_averages_float32_gradients_in_bfloat16_on_cpu(mlp):
    """Paddle's fp16_allreduce (float32 parameters, CPU: bfloat16): every gradient is cast down for the average, so
    the bucket is half the bytes, and the update reads the float32 cast of the average, taken after the wait."""
    plain, _ = run_data_parallel_passes(mlp)
    program, history = run_data_parallel_passes(mlp, fp16_allreduce=True)
    buckets = [[p.var(op.args[0].name) for op in p.global_block.ops if op.type == START] for p in (plain, program)]
    assert {v.dtype for v in buckets[0]} == {"float32"} and {v.dtype for v in buckets[1]} == {"bfloat16"}
    assert 2 * sum(v.nbytes() for v in buckets[1]) == sum(v.nbytes() for v in buckets[0])
    block = program.global_block
    waited = {name: i for i, op in enumerate(block.ops) if op.type == WAIT for name in op.outputs}
    for op in (op for _, op in program.walk_ops() if op.attrs.get("param") in PARAMS):
        grad = next(ref.name for ref in op.args if getattr(ref, "name", "").startswith(f"{op.attrs['param']}@GRAD"))
        cast = next(c for c in block.ops if grad in c.outputs)
        assert cast.type == "aten._to_copy.default" and program.var(grad).dtype == "float32"
        assert block.ops.index(cast) > waited[cast.args[0].name], op.name
    report = history["insert_allreduce"].report
    assert report.stats["fp16_allreduce_gradients"] == 6
    assert any(note.startswith("fp16_allreduce: 6 float32 gradients cast to bfloat16") for note in report.notes)


def test_fp16_allreduce_in_one_process_is_reported_not_applied(mlp):
    _, history = run_data_parallel_passes(mlp, 1, fp16_allreduce=True)
    assert history["insert_allreduce"].report.skipped_reason.startswith("single process")
