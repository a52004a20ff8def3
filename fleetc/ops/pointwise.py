"""The pointwise aten ops a fused kernel can compute, and their expressions (written in Triton's syntax).

This is the step language of `fleetc.fused_elementwise`: auto fusion asks `can_lower` what it may fuse, and
the code generators render the expressions.

Lowerings use only Triton builtins (`tl.exp`, `tl.where`, `tl.math.erf`, …), never the `@triton.jit`
helpers of `triton.language.standard` (`tl.sigmoid`, `tl.sum`, `tl.zeros`): those are decorated when triton is first
imported, so they fail inside interpreted kernels when triton was imported before TRITON_INTERPRET was set.

Each lowering takes the operands as Triton source text (a value name such as `v3`, or a constant
already written as source) plus the op's keyword arguments, and returns one expression. Float math
runs in fp32 (inputs are upcast on load, results cast on store), as torch does inside its own kernels.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from fleetc.ops.activations import activation_call, activation_grad_call

_SQRT1_2 = repr(math.sqrt(0.5))
_SQRT_2_OVER_PI = repr(math.sqrt(2 / math.pi))
_INV_SQRT_2PI = repr(1 / math.sqrt(2 * math.pi))


class LoweringError(Exception):
    """An op (or an argument of it) that a fused kernel cannot express."""


def constant(value: Any) -> str:
    """A Python constant as Triton source (infinities and NaN need a call)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f'float("{value!r}")'
    raise LoweringError(f"constant {value!r} of type {type(value).__name__} has no Triton form")


def _sigmoid(x: str) -> str:
    return f"(1.0 / (1.0 + tl.exp(-({x}))))"


def _tanh(x: str) -> str:
    return f"(2.0 * {_sigmoid(f'2.0 * ({x})')} - 1.0)"


def _gelu(x: str, approximate: str = "'none'") -> str:
    if approximate == "'tanh'":
        inner = f"{_SQRT_2_OVER_PI} * (({x}) + 0.044715 * ({x}) * ({x}) * ({x}))"
        return f"(0.5 * ({x}) * (1.0 + {_tanh(inner)}))"
    if approximate != "'none'":
        raise LoweringError(f"gelu approximate={approximate}")
    return f"(0.5 * ({x}) * (1.0 + tl.math.erf(({x}) * {_SQRT1_2})))"


def _gelu_backward(grad: str, x: str, approximate: str = "'none'") -> str:
    if approximate == "'tanh'":
        inner = f"{_SQRT_2_OVER_PI} * (({x}) + 0.044715 * ({x}) * ({x}) * ({x}))"
        t = _tanh(inner)
        d_inner = f"{_SQRT_2_OVER_PI} * (1.0 + 3.0 * 0.044715 * ({x}) * ({x}))"
        return f"(({grad}) * (0.5 * (1.0 + {t}) + 0.5 * ({x}) * (1.0 - {t} * {t}) * {d_inner}))"
    if approximate != "'none'":
        raise LoweringError(f"gelu_backward approximate={approximate}")
    cdf = f"(0.5 * (1.0 + tl.math.erf(({x}) * {_SQRT1_2})))"
    pdf = f"({_INV_SQRT_2PI} * tl.exp(-0.5 * ({x}) * ({x})))"
    return f"(({grad}) * ({cdf} + ({x}) * {pdf}))"


def _pow(x: str, exponent: str) -> str:
    forms = {"2": f"(({x}) * ({x}))", "2.0": f"(({x}) * ({x}))", "3": f"(({x}) * ({x}) * ({x}))",
             "3.0": f"(({x}) * ({x}) * ({x}))", "0.5": f"tl.sqrt({x})", "-0.5": f"tl.rsqrt({x})",
             "-1": f"(1.0 / ({x}))", "-1.0": f"(1.0 / ({x}))", "1": f"({x})", "1.0": f"({x})"}
    if exponent not in forms:
        raise LoweringError(f"pow with exponent {exponent}")
    return forms[exponent]


def _with_alpha(op: str) -> Callable[..., str]:
    def lower(a: str, b: str, alpha: str = "1") -> str:
        return f"(({a}) {op} ({b}))" if alpha == "1" else f"(({a}) {op} ({alpha}) * ({b}))"

    return lower


def _binary(op: str) -> Callable[..., str]:
    return lambda a, b: f"(({a}) {op} ({b}))"


def _true_division(a: str, b: str, rounding_mode: str = "None") -> str:
    if rounding_mode != "None":
        raise LoweringError(f"div rounding_mode={rounding_mode}")
    return f"(({a}) / ({b}))"


_LOWERINGS: dict[str, Callable[..., str]] = {
    "aten.add.Tensor": _with_alpha("+"),
    "aten.add.Scalar": _with_alpha("+"),
    "aten.sub.Tensor": _with_alpha("-"),
    "aten.sub.Scalar": _with_alpha("-"),
    "aten.rsub.Scalar": lambda a, b, alpha="1": _with_alpha("-")(b, a, alpha),
    "aten.mul.Tensor": _binary("*"),
    "aten.mul.Scalar": _binary("*"),
    "aten.div.Tensor": _true_division,
    "aten.div.Scalar": _true_division,
    "aten.neg.default": lambda a: f"(-({a}))",
    "aten.reciprocal.default": lambda a: f"(1.0 / ({a}))",
    "aten.abs.default": lambda a: f"tl.abs({a})",
    "aten.exp.default": lambda a: f"tl.exp({a})",
    "aten.log.default": lambda a: f"tl.log({a})",
    "aten.sqrt.default": lambda a: f"tl.sqrt({a})",
    "aten.rsqrt.default": lambda a: f"tl.rsqrt({a})",
    "aten.pow.Tensor_Scalar": _pow,
    "aten.relu.default": lambda a: f"tl.where(({a}) > 0.0, ({a}), 0.0)",
    "aten.threshold_backward.default": lambda g, x, t: f"tl.where(({x}) <= ({t}), 0.0, ({g}))",
    "aten.leaky_relu.default": lambda a, slope="0.01": f"tl.where(({a}) > 0.0, ({a}), ({a}) * ({slope}))",
    "aten.leaky_relu_backward.default":
        lambda g, x, slope, self_is_result: f"tl.where(({x}) > 0.0, ({g}), ({g}) * ({slope}))",
    "aten.sigmoid.default": _sigmoid,
    "aten.sigmoid_backward.default": lambda g, y: f"(({g}) * (1.0 - ({y})) * ({y}))",
    "aten.tanh.default": _tanh,
    "aten.tanh_backward.default": lambda g, y: f"(({g}) * (1.0 - ({y}) * ({y})))",
    "aten.silu.default": lambda a: f"(({a}) * {_sigmoid(a)})",
    "aten.silu_backward.default":
        lambda g, x: f"(({g}) * {_sigmoid(x)} * (1.0 + ({x}) * (1.0 - {_sigmoid(x)})))",
    "aten.gelu.default": _gelu,
    "aten.gelu_backward.default": _gelu_backward,
    "aten.native_dropout_backward.default": lambda g, mask, scale: f"tl.where({mask}, ({g}) * ({scale}), 0.0)",
    "aten.masked_fill.Scalar": lambda x, mask, value: f"tl.where({mask}, {value}, ({x}))",
    "aten.where.self": lambda cond, a, b: f"tl.where({cond}, ({a}), ({b}))",
    "aten.bitwise_not.default": lambda a: f"(({a}) == 0)",
    "aten.eq.Scalar": _binary("=="),
    "aten.ne.Scalar": _binary("!="),
    "aten.gt.Scalar": _binary(">"),
    "aten.ge.Scalar": _binary(">="),
    "aten.lt.Scalar": _binary("<"),
    "aten.le.Scalar": _binary("<="),
}

# Pointwise ops that are only expressible for some dtypes: bitwise_not of a bool is logical not.
_BOOL_ONLY = {"aten.bitwise_not.default"}

# Reductions a fused kernel can end in: op type → whether it divides by the reduced element count.
REDUCTIONS = {"aten.sum.dim_IntList": False, "aten.mean.dim": True}


def lower(op_type: str, args: list[str], kwargs: dict[str, str]) -> str:
    """The Triton expression of one pointwise op; LoweringError when it has none."""
    if op_type not in _LOWERINGS:
        raise LoweringError(f"no Triton lowering for {op_type}")
    try:
        return _LOWERINGS[op_type](*args, **kwargs)
    except TypeError as exc:
        raise LoweringError(f"{op_type} with these arguments: {exc}") from None


def can_lower(op_type: str, args: tuple, kwargs: dict, output_dtype: str) -> bool:
    """Whether `lower` accepts this op; tensor operands are passed as any non-constant placeholder."""
    if op_type in _BOOL_ONLY and output_dtype != "bool":
        return False
    try:
        lower(op_type, [_placeholder(a) for a in args], {k: _placeholder(v) for k, v in kwargs.items()})
    except LoweringError:
        return False
    return True


def _placeholder(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    try:
        return constant(value)
    except LoweringError:
        return "x"  # a tensor operand


class Operand(str):
    """Triton source naming a value (not a string constant) inside an op call given as data."""


def _source_text(value: Any) -> str:
    if isinstance(value, Operand):
        return str(value)
    return repr(value) if isinstance(value, str) else constant(value)


def lower_call(op_type: str, args: tuple, kwargs: tuple) -> str:
    """The Triton expression of an op call given as data: Operand arguments are values, the rest constants."""
    return lower(op_type, [_source_text(a) for a in args], {k: _source_text(v) for k, v in kwargs})


def activation_expression(act_name: str, param: Any, x: str) -> str:
    """The Triton expression of an activation of the value `x`, lowered as the captured op is."""
    return lower_call(*activation_call(act_name, Operand(x), param))


def activation_grad_expression(act_name: str, param: Any, grad: str, saved: str) -> str:
    """The Triton expression of an activation's gradient from `grad` and the value its grad op saves."""
    return lower_call(*activation_grad_call(act_name, Operand(grad), Operand(saved), param))
