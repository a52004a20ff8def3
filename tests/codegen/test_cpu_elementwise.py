"""The CPU backend's step-list kernels (fused_elementwise, add+act, dropout+add) against their aten references.

Shapes cover broadcasting (a bias, a column, a scalar), non-contiguous inputs (transposed, strided slices), odd
sizes and sizes large enough for several OpenMP threads, fp32 and bf16. Chains of exact ops (add, sub with alpha,
mul, div, relu, where, masked_fill, comparisons) must match aten bit for bit, in bf16 too (each step is rounded
as aten stores it); transcendental steps (exp, tanh, erf: fleetc's inline fc_exp/fc_tanh/fc_erf; log: libmvec) within
TRANSCENDENTAL tolerances.
"""
from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernels import assert_outputs, plan_for, run_both

from fleetc.ops.activations import ACTIVATIONS as ACTIVATION_TABLE
from fleetc.ops.activations import activation_call
from fleetc.ops.fused_elementwise import operand

pytestmark = pytest.mark.usefixtures("cpu_kernel_cache")

# Stated tolerances of the transcendental kernels (fc_exp/fc_tanh/fc_erf, libmvec logf: a few ulp in fp32; one bf16
# rounding).
TRANSCENDENTAL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
# One bf16 rounding apart on operands of magnitude up to 4 (a sum that cancels keeps the operands' absolute error).
ONE_BF16_ROUNDING = dict(rtol=1.6e-2, atol=3.2e-2)
EXACT_CHAIN = ((("aten.add.Tensor", (operand(0), operand(1)), ()),
                ("aten.relu.default", (operand(2),), ()),
                ("aten.mul.Tensor", (operand(3), operand(0)), ()),
                ("aten.sub.Tensor", (operand(4), operand(1)), ()),
                ("aten.div.Scalar", (operand(5), 3.0), ()),
                ("aten.gt.Scalar", (operand(0), 0.25), ()),
                ("aten.masked_fill.Scalar", (operand(6), operand(7), float("-inf")), ())), (6, 8))
SHAPES = [  # (x shape, y shape, how x is laid out)
    ((37,), (37,), "contiguous"),
    ((5, 7, 9), (9,), "contiguous"),  # bias broadcast along the innermost dim
    ((6, 11), (6, 1), "contiguous"),  # column broadcast: y's innermost stride is 0
    ((3, 1, 13), (4, 13), "contiguous"),  # both broadcast
    ((129, 300), (300,), "contiguous"),  # more than one thread's grain
    ((17, 23), (17, 23), "transposed"),
    ((9, 40), (9, 1), "sliced"),
    ((), (), "contiguous"),  # 0-dim
]


def make(shape: tuple, dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "transposed":
        return torch.randn(shape[::-1], generator=g).to(dtype).t()
    if layout == "sliced":
        return torch.randn(shape[0], 2 * shape[1] + 1, generator=g).to(dtype)[:, 1::2]
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape,y_shape,layout", SHAPES)
def test_chains_of_exact_ops_match_aten_bit_for_bit(x_shape, y_shape, layout, dtype):
    x, y = make(x_shape, dtype, layout, 0), make(y_shape, dtype, "contiguous", 1)
    steps, results = EXACT_CHAIN
    kwargs = dict(steps=steps, results=results, name="exact_chain")
    assert plan_for("fleetc.fused_elementwise", (x, y), kwargs).exact
    got, want, _, _ = run_both("fleetc.fused_elementwise", (x, y), kwargs)
    assert_outputs(got, want, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_with_alpha_is_close_not_exact(dtype):
    """aten fuses `a + alpha * b` in its vectorized loops only: the kernel's fma matches those, not every element."""
    x, y = make((6, 11), dtype, "contiguous", 0), make((6, 1), dtype, "contiguous", 1)
    call = dict(steps=(("aten.sub.Tensor", (operand(0), operand(1)), (("alpha", 0.37),)),), results=(2,), name="sub")
    assert not plan_for("fleetc.fused_elementwise", (x, y), call).exact
    got, want, _, _ = run_both("fleetc.fused_elementwise", (x, y), call)
    assert_outputs(got, want, exact=False, **TRANSCENDENTAL[dtype])


TRANSCENDENTAL_STEPS = [
    ("aten.gelu.default", (), (("approximate", "none"),)), ("aten.gelu.default", (), (("approximate", "tanh"),)),
    ("aten.tanh.default", (), ()), ("aten.exp.default", (), ()), ("aten.sigmoid.default", (), ()),
    ("aten.silu.default", (), ()), ("aten.log.default", (), ()), ("aten.rsqrt.default", (), ()),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op_type,extra,kwargs", TRANSCENDENTAL_STEPS, ids=lambda v: str(v))
def test_transcendental_steps_within_their_stated_tolerance(op_type, extra, kwargs, dtype):
    x = make((33, 65), dtype, "contiguous", 2)
    y = make((65,), dtype, "contiguous", 3).abs() + 0.5
    steps = (("aten.mul.Tensor", (operand(0), operand(1)), ()), (op_type, (operand(2), *extra), kwargs))
    if op_type in ("aten.log.default", "aten.rsqrt.default"):
        steps = (("aten.abs.default", (operand(0),), ()), ("aten.add.Tensor", (operand(2), operand(1)), ()),
                 (op_type, (operand(3),), ()))
    call = dict(steps=steps, results=(len(steps) + 1,), name="transcendental")
    got, want, _, _ = run_both("fleetc.fused_elementwise", (x, y), call)
    assert_outputs(got, want, exact=False, **TRANSCENDENTAL[dtype])


REDUCTIONS = [  # (input shape, reduction op, dims, keepdim): the innermost dim reduced (rows) or kept (columns)
    ((64, 33), "aten.sum.dim_IntList", (1,), False),
    ((64, 33), "aten.sum.dim_IntList", (0,), True),
    ((4, 6, 5, 7), "aten.sum.dim_IntList", (0, 2, 3), True),
    ((4, 6, 5, 7), "aten.mean.dim", (1, 2), False),
    ((300, 257), "aten.sum.dim_IntList", (0,), False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,reduction,dims,keepdim", REDUCTIONS)
def test_pointwise_then_reduction_matches_aten(shape, reduction, dims, keepdim, dtype):
    g, y = make(shape, dtype, "contiguous", 4), make(shape, dtype, "contiguous", 5)
    steps = (("aten.threshold_backward.default", (operand(0), operand(1), 0), ()),
             (reduction, (operand(2), dims, keepdim), ()))
    call = dict(steps=steps, results=(2, 3), name="grad_and_sum")
    got, want, _, _ = run_both("fleetc.fused_elementwise", (g, y), call)
    assert_outputs(got[0], want[0], exact=True)  # the pointwise result is exact; the sum adds in another order
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    assert_outputs(got[1], want[1], exact=False, **tolerance)


ACTIVATIONS = [("relu", None), ("gelu", "none"), ("gelu", "tanh"), ("silu", None), ("sigmoid", None),
               ("tanh", None), ("leaky_relu", 0.2), ("scale", 2.0)]
EXACT_ACTIVATIONS = {"relu", "leaky_relu", "scale"}


@pytest.mark.parametrize("act,param", ACTIVATIONS)
@pytest.mark.parametrize("act_first", [False, True])
@pytest.mark.parametrize("y_shape", [(8, 35), (35,)])
def test_add_act_and_its_grad(act, param, act_first, y_shape):
    x, y = make((8, 35), torch.float32, "contiguous", 6), make(y_shape, torch.float32, "contiguous", 7)
    exact = act in EXACT_ACTIVATIONS
    got, want, _, _ = run_both("fleetc.fused_elemwise_add_act", (x, y, act_first, act, param))
    assert_outputs(got, want, exact=exact, **TRANSCENDENTAL[torch.float32])
    act_input, act_output = (y, want[1]) if act_first else (want[1], want[0])
    saved = {"input": act_input, "output": act_output, None: None}[ACTIVATION_TABLE[act].saves]
    dout = make(tuple(act_output.shape), torch.float32, "contiguous", 8)
    got, want, _, _ = run_both("fleetc.fused_elemwise_add_act_grad", (dout, saved, act, param))
    assert_outputs(got, want, exact=exact, **TRANSCENDENTAL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13,), (64, 129), (3, 50, 257)])
def test_dropout_add_keeps_eagers_rng_stream_and_arithmetic(shape, dtype):
    """Same seed, same mask as native_dropout draws; fp32 output and gradient bit for bit (bf16: aten's scalar
    loops multiply by a bf16-rounded scale, its vector loops by the fp32 one, so bf16 is within one rounding)."""
    x, residual = make(shape, dtype, "contiguous", 9), make(shape, dtype, "contiguous", 10)
    exact = dtype == torch.float32
    assert plan_for("fleetc.fused_dropout_add", (x, residual, 0.3, True)).exact == exact
    got, want, _, _ = run_both("fleetc.fused_dropout_add", (x, residual, 0.3, True), seed=123)
    assert torch.equal(got[1], want[1])
    assert_outputs(got, want, exact=exact, **ONE_BF16_ROUNDING)
    torch.manual_seed(123)
    eager_mask = torch.ops.aten.native_dropout.default(x, 0.3, True)[1]
    assert torch.equal(got[1], eager_mask)
    dout = make(shape, dtype, "contiguous", 11)
    got, want, _, _ = run_both("fleetc.fused_dropout_add_grad", (dout, want[1], 1 / 0.7))
    assert_outputs(got, want, exact=exact, **ONE_BF16_ROUNDING)


def test_activation_kernels_come_from_the_shared_lowering():
    """No second activation table: the add+act kernel's source holds the C form of the shared lowering."""
    from fleetc.ops.pointwise import C, lower_call, Operand

    plan = plan_for("fleetc.fused_elemwise_add_act", (torch.randn(4, 8), torch.randn(8), False, "gelu", "tanh"))
    op_type, args, kwargs = activation_call("gelu", Operand("v2"), "tanh")
    assert lower_call(op_type, args, kwargs, C) in plan.kernels[0].code
