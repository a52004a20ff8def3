"""memory_optimize (buffer reuse): the zoo matches eager and is bit-identical to memory_optimize off, alone and with
enable_inplace, recompute, gradient merge, auto fusion and the multi-threaded scheduler; the planned peak does not
change, and the measured one does not grow; an eval Program with reused buffers exports."""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import run_side_by_side
from helpers.export import eager_eval, trained
from zoo import ZOO

import fleetc
from fleetc import fleet
from fleetc.fleet import export_sources
from fleetc.fleet.inference import MODEL_FILE
from fleetc.ir.liveness import estimate_memory

# Zoo models with a matmul or sum result that can take a dead temporary's buffer (the cnn's are convolutions).
REUSING = ("gpt", "loss_dict", "mlp")


def _strategy(reuse: bool, **fields) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.memory_optimize = reuse
    for key, value in fields.items():
        setattr(strategy, key, value)
    return strategy




def _reused(trainer: fleetc.CompiledTrainer) -> int:
    return trainer.report().stats.get("reuse_buffers", {}).get("buffers_reused", 0)


@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_zoo_matches_eager_and_the_bits_without_it(zoo_name):
    on = run_side_by_side(zoo_name, "adam", steps=3, strategy=_strategy(True), measure_memory=True)
    off = run_side_by_side(zoo_name, "adam", steps=3, strategy=_strategy(False), measure_memory=True)
    on.assert_same()
    on.assert_compiled_identical(off)
    assert (_reused(on.trainer) > 0) == (zoo_name in REUSING)
    assert ("reuse_buffers" in on.trainer.report().skipped) == (zoo_name not in REUSING)
    planned_on, planned_off = on.trainer.memory_stats(), off.trainer.memory_stats()
    assert planned_on["estimated_peak_bytes"] == planned_off["estimated_peak_bytes"]
    assert planned_on["measured_peak_bytes"] <= planned_off["measured_peak_bytes"]


def test_each_rewritten_op_writes_into_a_temporary_dead_before_it_and_the_planned_peak_stays():
    run = run_side_by_side("gpt", "sgd", steps=1, strategy=_strategy(True))
    names = run.trainer.history.names()
    before = run.trainer.history[names.index("reuse_buffers") - 1].program
    after = run.trainer.history["reuse_buffers"].program
    position = {op.name: i for i, op in enumerate(before.global_block.ops)}
    types = {op.name: op.type for op in before.global_block.ops}
    rewritten = [op for op in after.global_block.ops if types[op.name] != op.type]
    assert len(rewritten) == _reused(run.trainer) > 0
    for op in rewritten:
        assert (types[op.name], op.type) in {("aten.mm.default", "aten.mm.out"), ("aten.addmm.default", "aten.addmm.out"),
                                             ("aten.bmm.default", "aten.bmm.out"),
                                             ("aten.sum.dim_IntList", "aten.sum.IntList_out")}
        buffer, result = before.var(op.kwargs["out"].name), before.var(op.outputs[0])
        assert (buffer.shape, buffer.dtype, buffer.device) == (result.shape, result.dtype, result.device)
        readers = [i for i, other in enumerate(before.global_block.ops) if buffer.name in other.inputs]
        assert max(readers) < position[op.name], f"{op.name} writes {buffer.name} while it is still read"
    assert estimate_memory(after).peak_bytes == estimate_memory(before).peak_bytes


COMBINATIONS = {
    "inplace": {"build_strategy": {"enable_inplace": True, "memory_optimize": True}},
    "recompute": {"recompute": True, "recompute_configs": {"checkpoints": ["layers.0", "layers.1"]}},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
    "auto_fusion": {"build_strategy": {"enable_auto_fusion": True, "memory_optimize": True}},
    "threads": {"execution_strategy": {"num_threads": 4}},
}


@pytest.mark.parametrize("combination", [pytest.param(c, marks=[] if c in ("threads", "inplace") else
                                                      [pytest.mark.slow]) for c in sorted(COMBINATIONS)])
def test_gpt_with_dropout_keeps_its_bits_combined_with(combination):
    fields = COMBINATIONS[combination]
    steps = 4 if combination == "gradient_merge" else 2  # two updates of two merged steps
    on = run_side_by_side("gpt", "sgd", steps=steps, strategy=_strategy(True, **fields))
    off_fields = {k: ({**v, "memory_optimize": False} if k == "build_strategy" else v) for k, v in fields.items()}
    off = run_side_by_side("gpt", "sgd", steps=steps, strategy=_strategy(False, **off_fields))
    if combination != "gradient_merge":  # merged training matches eager accumulation, which
        on.assert_same()                 # tests/passes/test_gradient_merge.py checks for the run without it
    on.assert_compiled_identical(off)
    assert _reused(on.trainer) > 0


def test_an_eval_program_with_reused_buffers_exports_and_matches_eager_eval(tmp_path):
    trainer, args, kwargs = trained(ZOO["gpt"], _strategy(True), steps=1)
    inputs = export_sources.named_inputs(trainer.model, args, kwargs)
    with warnings.catch_warnings():  # the static-batch note is not what this checks
        warnings.simplefilter("ignore")
        result = fleet.save_inference_model(None, str(tmp_path), list(inputs), ["output"], main_program=trainer)
    eval_program = result.artifacts[0].history["eval"].program
    assert any(op.type.endswith(".out") for op in eval_program.global_block.ops)  # a buffer was reused
    got = torch.export.load(str(tmp_path / MODEL_FILE)).module()(*inputs.values())
    torch.testing.assert_close(got, eager_eval(trainer.model, **inputs), rtol=1e-5, atol=1e-6)
