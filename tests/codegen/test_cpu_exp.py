"""The CPU kernels' inline exp, tanh and erf (`fc_exp`, `fc_tanh`, `fc_erf` in fleetc/codegen/cpu/source.py) on a dense fp32 range.

They run as the generated kernels of a one-step `fused_elementwise` (aten.exp / aten.tanh), on every 251st fp32
bit pattern in range plus the edge values: the overflow and underflow thresholds, the denormal results, ±inf, NaN,
±0. Against float64 exp/tanh: at most 1.02 ulp (fc_exp) and 1.5e-7 relative (fc_tanh) over normal results,
within one unit of 2^-149 on denormal results; where torch.exp gives inf, 0 or NaN, so does fc_exp (bar the
denormal rounding at the underflow edge); fc_tanh gives torch's ±0, ±1, NaN and tiny values, and its signs.
"""
from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernels import cpu_kernel

from fleetc.ops.fused_elementwise import operand

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny
DENORMAL_UNIT = 2.0 ** -149
EDGES = [float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30, 1e-45, 88.72283, 88.722839, 88.7228,
         88.8, 89.0, 1e4, -87.33, -87.34, -103.97, -103.972, -103.98, -104.0, -1e4, 0.625, -0.625, 0.62499]


def dense(low: float, high: float) -> torch.Tensor:
    """Every 251st fp32 bit pattern (both signs) that lies in (low, high), and the edge values."""
    patterns = torch.arange(0, 2 ** 32, 251, dtype=torch.int64).to(torch.int32).view(torch.float32)
    inside = patterns[torch.isfinite(patterns) & (patterns > low) & (patterns < high)]
    return torch.cat([inside, torch.tensor(EDGES)])


def run_step(op_type: str, x: torch.Tensor) -> torch.Tensor:
    call = {"steps": ((op_type, (operand(0),), ()),), "results": (1,), "name": "dense"}
    return cpu_kernel("fleetc.fused_elementwise", (x,), call)(x, **call)


def ulps(got: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|got - truth| in units of the fp32 spacing at truth."""
    rounded = truth.float().abs()
    spacing = torch.nextafter(rounded, torch.tensor(float("inf"))).double() - rounded.double()
    return (got.double() - truth).abs() / spacing


def test_exp_within_one_ulp_and_exact_at_the_edges():
    x = dense(-110.0, 95.0)
    got, want, truth = run_step("aten.exp.default", x), torch.exp(x), torch.exp(x.double())
    normal = torch.isfinite(truth.float()) & (truth >= SMALLEST_NORMAL)
    assert normal.sum() > 10 ** 6
    assert ulps(got[normal], truth[normal]).max().item() <= 1.02
    denormal = (truth < SMALLEST_NORMAL) & (truth > 0)
    assert denormal.sum() > 1000
    assert (got[denormal].double() - truth[denormal]).abs().max().item() <= DENORMAL_UNIT
    for special in (torch.isinf(want), torch.isnan(want), want == 0):
        assert torch.equal(got[special].nan_to_num(), want[special].nan_to_num())
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(torch.isnan(got), torch.isnan(want))


def test_tanh_within_its_stated_error_and_keeps_signs():
    x = dense(-20.0, 20.0)
    got, want, truth = run_step("aten.tanh.default", x), torch.tanh(x), torch.tanh(x.double())
    normal = truth.abs() >= SMALLEST_NORMAL
    assert ((got.double() - truth).abs() / truth.abs())[normal].max().item() <= 1.5e-7
    edge = ~normal | (x.abs() >= 10)  # zeros, tiny values (tanh x = x), NaN, and the saturated ±1
    assert torch.equal(got[edge].nan_to_num(), want[edge].nan_to_num())
    assert torch.equal(torch.signbit(got), torch.signbit(want)) and torch.equal(torch.isnan(got), torch.isnan(want))


def test_gelu_through_the_inline_erf_within_its_stated_error():
    """GELU (erf form) through `fc_erf`: at most 3e-7 of max(|gelu x|, 1) from float64 (measured 2.6e-7; aten's
    own vectorized erf 1.1e-6), relative 2e-7 near 0 where erf is x times a polynomial; torch's NaNs and signs on
    finite inputs and NaN, NaN for -inf as torch; gelu(+inf) = +inf (aten gives NaN)."""
    x = dense(-12.0, 12.0)
    got, want = run_step("aten.gelu.default", x), torch.nn.functional.gelu(x)
    xd = x.double()
    truth = 0.5 * xd * (1 + torch.erf(xd * 0.5 ** 0.5))
    finite = torch.isfinite(x)
    error = (got.double() - truth).abs()
    assert (error / truth.abs().clamp(min=1.0))[finite].max().item() <= 3e-7
    near_zero = finite & (x.abs() < 1e-3) & (truth.abs() >= SMALLEST_NORMAL)
    assert (error / truth.abs())[near_zero].max().item() <= 2e-7
    assert torch.equal(torch.isnan(got[finite]), torch.isnan(want[finite]))
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
    edges = run_step("aten.gelu.default", torch.tensor([float("nan"), -float("inf"), float("inf")]))
    assert edges[:2].isnan().all() and edges[2].item() == float("inf")
