"""The channels_last pass (`build_strategy.conv_channels_last`): what it rewrites, and training that matches eager.

Differential checks:
- without the CPU backend, fleetc with the pass trains the zoo CNN bit for bit like eager PyTorch on a
  channels_last model (`model.to(memory_format=torch.channels_last)` with channels_last inputs): the same oneDNN
  convolutions run, so the pass adds no rounding of its own;
- against plain (NCHW) eager the convolutions add in another order, so parameters agree within fp32 tolerance
  under SGD and, under Adam(W), which divides each gradient element by its own running magnitude, within the CPU
  backend harness's 1e-4 (eager NCHW and eager channels_last differ by as much: 2.4e-6 on a conv weight after three
  AdamW steps of the zoo CNN);
- with every fusion flag and the CPU backend (its NHWC batch-norm kernels), within the same tolerances.
The Hugging Face convolution models: tests/models/test_channels_last_models.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import eager_step, run_side_by_side
from zoo import OPTIMIZERS, ZOO

import fleetc
from fleetc.ir.program import Op, Program, Ref, Var, VarKind
from fleetc.passes.layout import ChannelsLast
from fleetc.passes.order import fusion_flags, ordered_passes

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

CLONE = "aten.clone.default"


def channels_last_strategy(fused: bool = False) -> fleetc.DistributedStrategy:
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.conv_channels_last = True
    if fused:
        for flag in fusion_flags():
            setattr(strategy.build_strategy, flag, True)
        strategy.build_strategy.enable_auto_fusion = True
    return strategy


def _nhwc(value):
    return value.contiguous(memory_format=torch.channels_last) if isinstance(value, torch.Tensor) and \
        value.dim() == 4 else value


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_zoo_cnn_trains_bit_for_bit_like_eager_on_a_channels_last_model(optimizer_name):
    entry, make_optimizer = ZOO["cnn"], OPTIMIZERS[optimizer_name]
    torch.manual_seed(0)
    compiled_model = entry.make_model()
    eager_model = copy.deepcopy(compiled_model).to(memory_format=torch.channels_last)
    eager_opt, compiled_opt = make_optimizer(eager_model.parameters()), make_optimizer(compiled_model.parameters())
    trainer = fleetc.compile(compiled_model, channels_last_strategy(), optimizer=compiled_opt, loss_fn=entry.loss_fn,
                             verify=True)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        args, kwargs = entry.make_batch(g)
        torch.manual_seed(100 + i)
        want = eager_step(eager_model, eager_opt, entry.loss_fn, tuple(_nhwc(a) for a in args), kwargs)
        torch.manual_seed(100 + i)
        assert torch.equal(trainer.step(*args, **kwargs), want), f"loss of step {i}"
    compiled, eager = compiled_model.state_dict(), eager_model.state_dict()
    for name in eager:
        assert torch.equal(compiled[name], eager[name]), name
    report = trainer.history["channels_last"].report
    assert report.changed and report.stats["convolutions"] == 5 and report.stats["to_channels_last"] == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("optimizer_name", ["momentum", "adamw"])
def test_zoo_cnn_matches_nchw_eager_within_fp32_tolerance(optimizer_name, fused):
    run = run_side_by_side("cnn", optimizer_name, strategy=channels_last_strategy(fused),
                           cpu_kernels="sync" if fused else "off")
    adam_family = optimizer_name in ("adam", "adamw")
    run.assert_same(rtol=1e-4 if adam_family else 1e-5, atol=1e-4 if adam_family else 1e-5)
    if fused:
        usage = run.trainer.report().kernels
        bn = [op for op in usage.ops.values() if op.op_type.startswith("fleetc.fused_bn")]
        assert bn and all(any("_nhwc_" in k for k in op.kernels) and op.reference_calls == 0 and op.kernel_calls == 3
                          for op in bn), bn


def test_weight_gradients_are_handed_on_contiguous():
    """aten returns a weight gradient channels_last when the input is; the backward writes it under a new name and an
    NCHW copy takes the gradient's own name, so optimizers, buckets and grad fetches see what they see without the
    pass. A 1×1 convolution's weight gradient is the same memory in either layout and is not copied."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1))
    trainer = fleetc.compile(model, channels_last_strategy(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss_fn=lambda out, target: ((out - target) ** 2).mean(), verify=True)
    trainer.step(torch.randn(2, 3, 6, 5), torch.randn(2, 4, 6, 5))
    ops = trainer.history[-1].program.global_block.ops
    backward = next(op for op in ops if op.type == "aten.convolution_backward.default" and op.args[2] == Ref("0.weight"))
    assert backward.outputs[1] == "0.weight@GRAD@NHWC"
    copy_back = next(op for op in ops if "0.weight@GRAD" in op.outputs)
    assert copy_back.type == CLONE and copy_back.kwargs == {"memory_format": torch.contiguous_format}
    assert copy_back.args == (Ref("0.weight@GRAD@NHWC"),)
    assert trainer.history["channels_last"].report.stats["weight_grads_to_nchw"] == 1


def _view_program() -> Program:
    """conv → relu → view (flatten a 3×3 map); the relu's result is fetched too. The view and the fetch must read
    an NCHW copy (one, shared)."""
    program = Program()
    block = program.global_block
    for var in (Var("x", (2, 4, 5, 5), "float32", kind=VarKind.DATA),
                Var("w", (6, 4, 3, 3), "float32", kind=VarKind.PARAM),
                Var("y", (2, 6, 3, 3), "float32"), Var("r", (2, 6, 3, 3), "float32"), Var("f", (2, 54), "float32")):
        block.add_var(var)
    block.ops = [Op("conv", "aten.convolution.default", (Ref("x"), Ref("w"), None, [1, 1], [0, 0], [1, 1], False,
                                                         [0, 0], 1), outputs=["y"]),
                 Op("relu", "aten.relu.default", (Ref("y"),), outputs=["r"]),
                 Op("view", "aten.view.default", (Ref("r"), [2, 54]), outputs=["f"])]
    program.feeds, program.fetches = ["x"], {"output": "f", "features": "r"}
    return program


def test_views_and_fetches_read_nchw_copies():
    program, report = ChannelsLast().run(_view_program(), None)
    ops = {op.name: op for op in program.global_block.ops}
    types = [op.type for op in program.global_block.ops]
    assert types == [CLONE, "aten.convolution.default", "aten.relu.default", CLONE, "aten.view.default"]
    assert ops["conv"].args[0] == Ref("x@NHWC") and ops["view"].args[0] == Ref("r@NCHW")
    assert program.fetches == {"output": "f", "features": "r@NCHW"}
    assert report.stats == {"convolutions": 1, "to_channels_last": 1, "to_nchw": 1}
    x, w = torch.randn(2, 4, 5, 5), torch.randn(6, 4, 3, 3)
    values = {"x": x, "w": w}
    for op in program.global_block.ops:  # run it: the view works, values equal eager's
        fn = getattr(torch.ops.aten, op.type.split(".")[1]).default
        args = [values[a.name] if isinstance(a, Ref) else a for a in op.args]
        values[op.outputs[0]] = fn(*args, **op.kwargs)
    assert values["r"].is_contiguous(memory_format=torch.channels_last)
    want = torch.relu(torch.nn.functional.conv2d(x, w))
    torch.testing.assert_close(values["f"], want.reshape(2, 54))
    assert values["r@NCHW"].is_contiguous()


def test_the_flag_switches_the_pass_and_it_says_why_it_did_nothing():
    assert not any(p.name == "channels_last" for p in ordered_passes(fleetc.DistributedStrategy()))
    assert any(p.name == "channels_last" for p in ordered_passes(channels_last_strategy()))
    run = run_side_by_side("mlp", "sgd", steps=1, strategy=channels_last_strategy())
    report = run.trainer.history["channels_last"].report
    assert not report.changed and report.skipped_reason == "no 2-D convolution of a CPU tensor"


def test_amp_bf16_programs_are_rewritten_too():
    """AMP adds a conditional block (the update skipped on overflow) and bf16 casts: the pass still applies (the
    block's reads are renamed where needed), and training stays within a bf16 rounding of AMP without it."""
    strategy = channels_last_strategy(fused=True)
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    with_pass = run_side_by_side("cnn", "momentum", strategy=strategy, cpu_kernels="sync")
    strategy.build_strategy.conv_channels_last = False
    without = run_side_by_side("cnn", "momentum", strategy=strategy, cpu_kernels="sync")
    report = with_pass.trainer.history["channels_last"].report
    assert report.changed and report.stats["convolutions"] == 5 and report.stats["batch_norms_channels_last"] > 0
    for a, b in zip(with_pass.compiled_losses, without.compiled_losses):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_one_channel_convolutions_need_no_copy_and_the_report_says_so():
    program = _view_program()
    block = program.global_block
    block.vars["x"].shape, block.vars["w"].shape = (2, 1, 5, 5), (1, 1, 3, 3)
    for name in ("y", "r"):
        block.vars[name].shape = (2, 1, 3, 3)
    block.vars["f"].shape = (2, 9)
    block.ops[2].args = (Ref("r"), [2, 9])
    before = str(program)
    program, report = ChannelsLast().run(program, None)
    assert str(program) == before
    assert not report.changed and report.stats == {"convolutions": 1}
    assert report.skipped_reason == "every convolution's values are in the same memory order in both layouts"
