"""The measured choice between an op's kernel and its reference (fleetc/codegen/cpu/choice.py).

A kernel that measures slower than its reference is not kept; a faster one is; the sync mode always runs the
kernel; and in a background-mode training run every op with a kernel ends with a recorded choice while the
losses and parameters still match eager.
"""
from __future__ import annotations

import time

import pytest
import torch
from conftest import run_side_by_side
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.codegen.cpu import choice
from fleetc.codegen.cpu.backend import OpUsage
from fleetc.passes.order import fusion_flags

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

TRIAL_CALLS = 2 * (choice.WARMUP + choice.TRIALS)


def busy(seconds: float, result: str):
    """A callable that spends `seconds` of CPU (not sleeping: the choice may time CPU) and returns `result`."""
    def run(*args, **kwargs):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return result
    return run


@pytest.mark.parametrize("kernel_s, reference_s, winner", [(0.02, 0.0, "reference"), (0.0, 0.02, "kernel")])
def test_the_faster_implementation_is_kept_after_the_trials(kernel_s, reference_s, winner):
    usage = OpUsage("fleetc.probe")
    switch = choice.MeasuredSwitch(busy(reference_s, "reference"), usage, measure=True)
    assert switch(1) == "reference" and usage.reference_calls == 1  # no kernel loaded yet
    switch.kernel = busy(kernel_s, "kernel")
    ran = [switch(1) for _ in range(TRIAL_CALLS)]
    assert ran == ["kernel", "reference"] * (TRIAL_CALLS // 2)  # the trials alternate
    assert usage.chosen == winner and f"runs the {winner}" in usage.note
    assert [switch(1) for _ in range(5)] == [winner] * 5
    assert usage.kernel_calls + usage.reference_calls == 1 + TRIAL_CALLS + 5


def test_without_measuring_the_loaded_kernel_always_runs():
    usage = OpUsage("fleetc.probe")
    switch = choice.MeasuredSwitch(busy(0.0, "reference"), usage, measure=False)
    switch.kernel = busy(0.01, "kernel")
    assert [switch() for _ in range(TRIAL_CALLS + 2)] == ["kernel"] * (TRIAL_CALLS + 2)
    assert usage.chosen == "" and usage.reference_calls == 0


def test_background_training_records_a_choice_per_op_and_matches_eager():
    strategy = fleetc.DistributedStrategy()
    for flag in fusion_flags():
        setattr(strategy.build_strategy, flag, True)
    run_side_by_side("mlp", "sgd", steps=1, strategy=strategy, cpu_kernels="sync")  # builds the same kernels
    run = run_side_by_side("mlp", "sgd", steps=1 + TRIAL_CALLS, strategy=strategy, cpu_kernels="background")
    usage = run.trainer.report().kernels
    with_kernel = [name for name, op in usage.ops.items() if op.kernels and "failed" not in op.note]
    assert with_kernel, "the all-fusion mlp Program has ops with kernels"
    for name in with_kernel:
        assert usage.ops[name].chosen in ("kernel", "reference"), usage.ops[name]
        assert usage.implementation(name) == usage.ops[name].chosen
        assert "measured best of" in usage.ops[name].note
    run.assert_same(rtol=1e-5, atol=1e-5)


def test_sync_mode_reports_no_measurement():
    entry = ZOO["mlp"]
    torch.manual_seed(0)
    model = entry.make_model()
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_all_optimizer_ops = True
    trainer = fleetc.compile(model, strategy, optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=entry.loss_fn,
                             cpu_kernels="sync")
    batch, _ = entry.make_batch(torch.Generator().manual_seed(1))
    for _ in range(TRIAL_CALLS + 1):
        trainer.step(*batch)
    usage = trainer.report().kernels
    assert usage.ops and all(op.chosen == "" and op.reference_calls == 0 for op in usage.ops.values())
