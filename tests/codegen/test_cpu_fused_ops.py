"""The CPU backend's gemm epilogue, batch-norm and optimizer kernels against their aten references.

The optimizer updates must match bit for bit (they keep the README's promise that fused optimizers match
torch.optim exactly), on group members of odd sizes, larger than one work item, and with every option. The gemm
epilogue's activation and the batch-norm kernels are checked within fp32 tolerance (their reductions add in
another order than aten's), bf16 within a bf16 rounding; every output_mask and both train and eval.
"""
from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernels import assert_outputs, run_both

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

ACTIVATIONS = [("relu", None), ("gelu", "none"), ("gelu", "tanh"), ("silu", None), ("tanh", None), ("leaky_relu", 0.1)]
FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)
GROUP_SHAPES = [(33,), (64, 17), (5000,), (3, 3, 7)]  # odd sizes, one larger than a 4096-element work item


def group(seed: int, scale: float = 1.0, positive: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) * scale for s in GROUP_SHAPES]
    return [v.abs() for v in values] if positive else values


MIXED = [True, False, False, True]  # a parameter without a gradient on the first step has a fresh buffer later


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay,maximize,fresh", [
    (0.0, 0.0, False, 0.0, False, False), (0.9, 0.1, False, 1e-3, False, False), (0.9, 0.0, True, 0.0, False, False),
    (0.9, 0.0, False, 0.0, True, True), (0.5, 0.3, True, 1e-2, True, False), (0.9, 0.1, False, 1e-3, False, MIXED)])
def test_fused_sgd_matches_the_reference_bit_for_bit(momentum, dampening, nesterov, weight_decay, maximize, fresh):
    bufs = group(2) if momentum else None
    fresh = fresh if isinstance(fresh, list) else [fresh] * len(GROUP_SHAPES)
    args = (group(0), group(1), bufs, fresh, 0.05, momentum, dampening, nesterov, weight_decay, maximize)
    _, _, got, want = run_both("fleetc.fused_sgd", args)
    assert_outputs(got, want, exact=True)


@pytest.mark.parametrize("beta1,weight_decay,decoupled,maximize", [
    (0.9, 0.0, False, False), (0.9, 1e-3, False, False), (0.9, 1e-2, True, False), (0.6, 1e-2, True, True)])
def test_fused_adam_matches_the_reference_bit_for_bit(beta1, weight_decay, decoupled, maximize):
    """beta1 = 0.6 takes lerp's other formula (weight >= 0.5); step counters start at 3 and are incremented."""
    steps = [torch.tensor(3.0) for _ in GROUP_SHAPES]
    args = (group(0), group(1), group(2, 0.1), group(3, 0.01, positive=True), steps, 1e-2, beta1, 0.999, 1e-8,
            weight_decay, decoupled, maximize)
    _, _, got, want = run_both("fleetc.fused_adam", args)
    assert_outputs(got, want, exact=True)


def test_a_non_contiguous_parameter_runs_the_reference():
    params = [torch.randn(8, 6).t(), torch.randn(5)]
    grads = [torch.randn(6, 8), torch.randn(5)]
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    state = ([torch.zeros(6, 8), torch.zeros(5)], [torch.zeros(6, 8), torch.zeros(5)])
    args = (params, grads, *state, steps, 1e-2, 0.9, 0.999, 1e-8, 0.0, True, False)
    _, _, got, want = run_both("fleetc.fused_adam", args)
    assert_outputs(got, want, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,param", ACTIVATIONS)
@pytest.mark.parametrize("keep_pre_act", [False, True])
def test_gemm_epilogue_forward_and_backward(act, param, keep_pre_act, dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6 * 5, 19, generator=g).to(dtype), torch.randn(23, 19, generator=g).to(dtype)
    bias = torch.randn(23, generator=g).to(dtype)
    tolerance = FP32 if dtype == torch.float32 else BF16
    forward = (x, w.t(), bias, [6, 5, 23], act, param, keep_pre_act)
    got, want, _, _ = run_both("fleetc.fused_gemm_epilogue", forward)
    assert_outputs(got, want, exact=False, **tolerance)
    out, h = want
    saved = h if keep_pre_act else out
    if act in ("gelu", "silu", "leaky_relu") and not keep_pre_act:
        return  # these grads read h, which the pass keeps for them
    dout = torch.randn(6, 5, 23, generator=g).to(dtype)
    for mask in ([True, True, True], [True, False, True], [False, True, False]):
        got, want, _, _ = run_both("fleetc.fused_gemm_epilogue_grad", (dout, saved, x, w.t(), act, param, mask))
        assert_outputs(got, want, exact=False, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("act,param", [("relu", None), ("gelu", "none"), ("leaky_relu", 0.2)])
@pytest.mark.parametrize("residual", [False, True])
def test_batch_norm_act_forward_and_backward(act, param, training, residual, dtype):
    g = torch.Generator().manual_seed(1)
    shape = (4, 5, 7, 9)
    x = (torch.randn(shape, generator=g) * 3 + 2).to(dtype)
    weight, bias = torch.randn(5, generator=g), torch.randn(5, generator=g)
    running_mean, running_var = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.5
    tolerance = FP32 if dtype == torch.float32 else BF16
    stats = (weight, bias, running_mean, running_var, training, 0.1, 1e-5, act, param)
    if residual:
        res = torch.randn(shape, generator=g).to(dtype)
        got, want, got_args, want_args = run_both("fleetc.fused_bn_add_act", (x, res, *stats))
    else:
        got, want, got_args, want_args = run_both("fleetc.fused_bn_act", (x, *stats))
    assert_outputs(got, want, exact=False, **tolerance)
    assert_outputs(got_args, want_args, exact=False, **FP32)  # the running statistics, updated in place
    out, pre, mean, rstd = want
    saved = out if act == "relu" else pre
    dout = torch.randn(shape, generator=g).to(dtype)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        args = (dout, saved, x, weight, running_mean, running_var, mean, rstd, training, 1e-5, mask, act, param)
        got, want, _, _ = run_both("fleetc.fused_bn_act_grad", args)
        assert_outputs(got, want, exact=False, **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else BF16))
