"""The CPU backend per Program: sync and background builds, which implementation ran, report, dump-ir, failures.

And the whole differential harness with the backend on: every zoo model trained with every fusion flag on and
`cpu_kernels="sync"` matches eager training, and every fused op that has a kernel ran it (never silently the aten
fallback). Exact kernels keep results bit-identical; the others (batch-norm statistics, transcendentals, sums)
differ from aten by rounding, which the comparison allows: 1e-5 under SGD; under Adam, which divides each
gradient element by its own running magnitude, a near-zero gradient element's rounding moves its parameter by a
visible fraction of lr, so 1e-4 = lr / 100 there; and for the one parameter whose true gradient is zero, an
attention key bias, Adam turns the rounding noise itself into lr-sized steps (README, fused optimizers), so there
only the size of the step is bounded.
"""
from __future__ import annotations

import os

import pytest
import torch
from conftest import run_side_by_side
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.codegen.cpu import backend, format_kernels, toolchain
from fleetc.passes.order import fusion_flags

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")


def every_fusion_flag() -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    for flag in fusion_flags():
        setattr(strategy.build_strategy, flag, True)
    strategy.build_strategy.enable_auto_fusion = True
    return strategy


# Why a planned op may keep its reference in the zoo (anything else is a failure).
EXPECTED_REFERENCE = ("no activation", "reads no saved value")
FULL = os.environ.get("FLEETC_FULL") == "1"


def _assert_kernels_ran(trainer: fleetc.CompiledTrainer, steps: int) -> None:
    usage = trainer.report().kernels
    assert usage.mode == "sync"
    for name, op in usage.ops.items():
        if op.kernels:
            assert (op.kernel_calls, op.reference_calls) == (steps, 0), f"{name}: {op}"
        else:
            assert op.note.startswith(EXPECTED_REFERENCE) or "no activation" in op.note, f"{name}: {op.note}"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS) if FULL else ["momentum", "adamw"])
@pytest.mark.parametrize("zoo_name", sorted(ZOO))
def test_differential_harness_with_the_cpu_backend(zoo_name, optimizer_name):
    run = run_side_by_side(zoo_name, optimizer_name, strategy=every_fusion_flag(), cpu_kernels="sync")
    _assert_kernels_ran(run.trainer, steps=3)
    assert run.trainer.report().kernels.ops, "the all-fusion Program has fused ops"
    if zoo_name == "gpt" and optimizer_name in ("adam", "adamw"):
        lr, steps = 1e-2, 3
        for name, param in run.compiled_model.state_dict().items():
            if name.endswith("attn.qkv.bias"):
                key = slice(param.numel() // 3, 2 * param.numel() // 3)
                eager = run.eager_model.state_dict()[name]
                assert (param[key] - eager[key]).abs().max() <= 2 * lr * steps
                param[key] = eager[key]  # the rest of the comparison sees everything else
    adam_family = optimizer_name in ("adam", "adamw")
    run.assert_same(rtol=1e-4 if adam_family else 1e-5, atol=1e-4 if adam_family else 1e-5)


def test_sync_mode_runs_kernels_from_the_first_step_and_reports_them():
    run = run_side_by_side("cnn", "sgd", steps=1, strategy=every_fusion_flag(), cpu_kernels="sync")
    report = run.trainer.report()
    assert "cpu kernels (sync)" in str(report) and "fused_bn_relu_train_float32" in str(report)
    kinds = {run.trainer.report().kernels.implementation(n) for n in report.kernels.ops}
    assert "kernel" in kinds and "mixed" not in kinds


def test_background_mode_starts_on_the_reference_and_switches(monkeypatch, tmp_path):
    """A cold cache: the first step cannot wait for the compiler, later steps run the kernels."""
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend, "_BUILDS", {})
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    trainer = fleetc.compile(model, every_fusion_flag(), optimizer=OPTIMIZERS["adamw"](model.parameters()),
                             loss_fn=entry.loss_fn, cpu_kernels="background")
    batch, _ = entry.make_batch(torch.Generator().manual_seed(1))
    trainer.step(*batch)
    compiled = trainer._require_train()
    compiled.executable.cpu.wait()
    trainer.step(*batch)
    usage = trainer.report().kernels
    adam = next(op for op in usage.ops.values() if op.op_type == "fleetc.fused_adam")
    assert adam.kernel_calls >= 1 and adam.kernel_calls + adam.reference_calls == 2
    assert any(p.name.endswith(".so") for p in (tmp_path / "cpu").iterdir())


def test_a_failed_build_leaves_the_reference_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend, "_BUILDS", {})
    monkeypatch.setattr(toolchain, "compiler", lambda: "/bin/false")
    run = run_side_by_side("mlp", "adamw", steps=1, strategy=every_fusion_flag(), cpu_kernels="sync")
    usage = run.trainer.report().kernels
    assert all(op.kernel_calls == 0 for op in usage.ops.values())
    assert any("kernel build failed" in op.note for op in usage.ops.values())
    run.assert_same()


def test_off_is_the_default_and_unknown_modes_are_refused():
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=every_fusion_flag())
    assert run.trainer.report().kernels.mode == backend.resolve_mode(None)
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        fleetc.compile(torch.nn.Linear(2, 2), cpu_kernels="fast")


def test_dump_ir_kernels_shows_the_cpp_source():
    run = run_side_by_side("cnn", "adamw", steps=1, strategy=every_fusion_flag())
    text = format_kernels(run.trainer.program)
    assert 'extern "C" void fused_bn_relu_train_float32' in text and "fused_adam" in text
    assert "#pragma omp parallel for num_threads(nthreads)" in text
