"""The Hugging Face convolution models (ResNet, MobileNetV2, ConvNeXt) train like eager with the channels_last pass
(`build_strategy.conv_channels_last`, fleetc/passes/layout/channels_last.py) on top of the default and fusion presets:
explain's check (first-step gradients, parameters after SGD and AdamW steps, within its tolerances), the fusion
preset with the CPU backend's kernels (its NHWC batch-norm kernels included), and the pass must have rewritten
every compiled Program.
"""
from __future__ import annotations

import pytest
from factories import ARCHITECTURES

from fleetc.fleet import explain

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["default", "fusion"])
@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2", "convnext"])
def test_hugging_face_convolution_models_train_like_eager(name, preset, monkeypatch):
    made, compiled = explain._strategy, []

    def with_channels_last(preset_name, model):
        strategy = made(preset_name, model)
        strategy.build_strategy.conv_channels_last = True
        return strategy

    def recording(*args, **kwargs):
        compiled.append(compile_step(*args, **kwargs))
        return compiled[-1]

    compile_step = explain.compile_step
    monkeypatch.setattr(explain, "_strategy", with_channels_last)
    monkeypatch.setattr(explain, "compile_step", recording)
    if preset == "fusion":
        monkeypatch.setenv("FLEETC_CPU_KERNELS", "sync")
    case = ARCHITECTURES[name]()
    model, batches = case.build(explain.STEPS)
    outcome = explain.check_preset(model, batches, case.loss_fn, preset, verify=True)
    assert outcome.ok, f"{name} under {preset}: {outcome.construct} at {outcome.location or '?'}"
    reports = [t.history["channels_last"].report for t in compiled]
    assert reports and all(r.changed and r.stats["convolutions"] > 0 for r in reports), [r.summary() for r in reports]
