"""The CPU backend's row-wise kernels (layer norm, softmax, log-softmax and their backward) against aten.

Tolerances: fp32 within 1e-5 (1e-4 for the layer-norm gradients, whose dw/db sum over every row in another
order than aten's); bf16 within one bf16 rounding of the value (2e-2), since both sides round each result to
bf16 but may land on neighbouring values. Shapes include odd row lengths (masked SIMD tails), softmax rows of one value,
a leading dim large enough to split over threads, and non-contiguous inputs (which the kernels copy first).
"""
from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernels import assert_outputs, plan_for, run_both

from fleetc.codegen.cpu.plan import Unsupported

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

aten = torch.ops.aten
FP32 = {"rtol": 1e-5, "atol": 1e-5}
FP32_SUMS = {"rtol": 1e-4, "atol": 1e-4}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
SHAPES = [((3, 5, 37), 1), ((2, 4, 6, 8), 2), ((7, 3), 1), ((513, 64), 1)]


def tolerance(dtype: torch.dtype, sums: bool = False) -> dict:
    return BF16 if dtype == torch.bfloat16 else FP32_SUMS if sums else FP32


@pytest.mark.parametrize("shape,row_dims", SHAPES)
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
def test_layer_norm_forward_and_backward(shape, row_dims, dtype, param_dtype, affine):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 2 + 5).to(dtype)  # a large mean: the two-pass variance must hold
    normalized = list(shape[-row_dims:])
    weight = torch.randn(normalized, generator=g).to(param_dtype) if affine != "none" else None
    bias = torch.randn(normalized, generator=g).to(param_dtype) if affine == "weight_bias" else None
    got, want, _, _ = run_both("aten.native_layer_norm.default", (x, normalized, weight, bias, 1e-5))
    assert_outputs(got, want, exact=False, **tolerance(dtype))
    _, mean, rstd = want
    dy = torch.randn(shape, generator=g).to(dtype)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        mask = [mask[0], mask[1] and weight is not None, mask[2] and bias is not None]  # as autograd asks
        args = (dy, x, normalized, mean, rstd, weight, bias, mask)
        got, want, _, _ = run_both("aten.native_layer_norm_backward.default", args)
        if dtype == torch.bfloat16 and affine != "none" and mask[1]:
            # with a bf16 input aten's dw/db are off the float64 sums by units at 513 rows (even as fp32 tensors);
            # ours sums in fp32 and rounds once: compare both parameter gradients with the float64 sums instead
            assert_parameter_grads_near_truth(got[1:], dy, x, mean, rstd, row_dims)
            got, want = got[:1], want[:1]
        assert_outputs(got, want, exact=False, **tolerance(dtype, sums=True))


def assert_parameter_grads_near_truth(grads, dy, x, mean, rstd, row_dims: int) -> None:
    rows = list(range(x.dim() - row_dims))
    xhat = (x.double() - mean.double()) * rstd.double()
    for grad, truth in zip(grads, ((dy.double() * xhat).sum(rows), dy.double().sum(rows))):
        if grad is not None:
            bound = 2 ** -7 * truth.abs().max().item()  # two bf16 roundings of the largest value
            assert (grad.double() - truth).abs().max().item() <= bound


def test_layer_norm_of_a_non_contiguous_input():
    x = torch.randn(6, 10, 9).transpose(0, 1)
    weight, bias = torch.randn(9), torch.randn(9)
    got, want, _, _ = run_both("aten.native_layer_norm.default", (x, [9], weight, bias, 1e-5))
    assert_outputs(got, want, exact=False, **FP32)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 1), (513, 64), (2, 1000)])
def test_softmax_forward_and_backward(shape, dtype, log):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    x[..., 0] = -float("inf")  # masked positions, as attention masks write them
    forward = "aten._log_softmax.default" if log else "aten._softmax.default"
    backward = "aten._log_softmax_backward_data.default" if log else "aten._softmax_backward_data.default"
    if shape[-1] == 1:
        x = torch.randn(shape, generator=g).to(dtype)
    got, want, _, _ = run_both(forward, (x, -1, False))
    assert_outputs(got, want, exact=False, **tolerance(dtype))
    dy = torch.randn(shape, generator=g).to(dtype)
    got, want, _, _ = run_both(backward, (dy, want, len(shape) - 1, dtype))
    assert_outputs(got, want, exact=False, **tolerance(dtype))


def test_a_fully_masked_row_gives_nan_as_aten_does():
    x = torch.full((2, 8), -float("inf"))
    x[1] = torch.randn(8)
    got, want, _, _ = run_both("aten._softmax.default", (x, -1, False))
    assert torch.isnan(got[0]).all() and torch.isnan(want[0]).all()
    torch.testing.assert_close(got[1], want[1], **FP32)


@pytest.mark.parametrize("op_type,args,reason", [
    ("aten._softmax.default", (torch.randn(4, 5), 0, False), "not the last"),
    ("aten._softmax.default", (torch.randn(4, 5).half(), -1, True), "half_to_float"),
    ("aten._log_softmax.default", (torch.randn(4, 5).double(), -1, False), "float64"),
    ("aten.native_layer_norm.default", (torch.randn(4, 5), [5], torch.randn(5).double(), None, 1e-5), "float64"),
])
def test_what_keeps_the_reference_says_why(op_type, args, reason):
    with pytest.raises(Unsupported, match=reason):
        plan_for(op_type, args)
