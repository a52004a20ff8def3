"""The batch-norm kernels' channels_last (NHWC) paths against aten, on random odd shapes, fp32 and bf16.

The layout pass marks a fused batch-norm op `memory_format=channels_last` when its input is a channels_last
activation; the kernels must then read it as rows of channels and write channels_last results (no copy back to
NCHW), forward and backward, train and eval, with and without the residual. Statistics add in another order than
aten's, so fp32 is checked within fp32 tolerance and bf16 within a bf16 rounding.
"""
from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernels import assert_outputs, plan_for, run_both

from fleetc.codegen.cpu.norm import CHANNELS_LAST

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)
NHWC = {"memory_format": CHANNELS_LAST}
# odd sizes; the last one is above the one-thread grain, so rows are split over the threads
SHAPES = [(3, 5, 7, 9), (2, 17, 1, 3), (8, 33, 15, 17)]


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _assert_channels_last(tensors: tuple) -> None:
    for t in tensors:
        if t is not None and t.dim() == 4:
            assert t.is_contiguous(memory_format=torch.channels_last), f"a {list(t.shape)} result is not channels_last"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("act,param", [("relu", None), ("gelu", "none"), ("leaky_relu", 0.2)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_channels_last_batch_norm_act_forward_and_backward(shape, act, param, training, residual, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(shape, act, param, training, residual, dtype)
    finally:
        torch.set_num_threads(before)


def _check(shape, act, param, training, residual, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    c = shape[1]
    x = _channels_last((torch.randn(shape, generator=g) * 3 + 2).to(dtype))
    weight, bias = torch.randn(c, generator=g), torch.randn(c, generator=g)
    running_mean, running_var = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
    tolerance = FP32 if dtype == torch.float32 else BF16
    stats = (weight, bias, running_mean, running_var, training, 0.1, 1e-5, act, param)
    if residual:
        res = _channels_last(torch.randn(shape, generator=g).to(dtype))
        got, want, got_args, want_args = run_both("fleetc.fused_bn_add_act", (x, res, *stats), attrs=NHWC)
    else:
        got, want, got_args, want_args = run_both("fleetc.fused_bn_act", (x, *stats), attrs=NHWC)
    assert_outputs(got, want, exact=False, **tolerance)
    assert_outputs(got_args, want_args, exact=False, **FP32)  # the running statistics, updated in place
    _assert_channels_last(got)
    out, pre, mean, rstd = want
    saved = out if act == "relu" else pre
    dout = _channels_last(torch.randn(shape, generator=g).to(dtype))
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        args = (dout, saved, x, weight, running_mean, running_var, mean, rstd, training, 1e-5, mask, act, param)
        got, want, _, _ = run_both("fleetc.fused_bn_act_grad", args, attrs=NHWC)
        assert_outputs(got, want, exact=False, **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else BF16))
        _assert_channels_last(got)


def test_an_nchw_input_to_a_channels_last_op_is_converted_not_misread():
    """The mark is a plan, not a promise: an input that arrives NCHW is made channels_last first."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 5, 3, generator=g)
    stats = (torch.randn(6, generator=g), torch.randn(6, generator=g), torch.zeros(6), torch.ones(6), True, 0.1,
             1e-5, "relu", None)
    got, want, _, _ = run_both("fleetc.fused_bn_act", (x, *stats), attrs=NHWC)
    assert_outputs(got, want, exact=False, **FP32)
    _assert_channels_last(got)


def test_the_mark_selects_the_nhwc_kernels():
    x = torch.randn(2, 6, 5, 3)
    stats = (torch.ones(6), torch.zeros(6), torch.zeros(6), torch.ones(6), True, 0.1, 1e-5, "relu", None)
    assert all("_nhwc_" in k.name for k in plan_for("fleetc.fused_bn_act", (x, *stats), attrs=NHWC).kernels)
    assert not any("_nhwc_" in k.name for k in plan_for("fleetc.fused_bn_act", (x, *stats)).kernels)
