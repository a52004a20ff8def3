"""The pointwise aten ops a fused kernel can compute, and their expressions, in Triton or in C.

This is the step language of `fleetc.fused_elementwise`: auto fusion asks `can_lower` what it may fuse, and
the code generators render the expressions. One table of lowerings serves both backends: each lowering
writes its formula through a `Dialect` (`TRITON` for the CUDA kernels, `C` for the CPU kernels), which
spells the few builtins (exp, erf, where, float literals, fused multiply-add) in its kernel language.

In Triton, lowerings use only Triton builtins (`tl.exp`, `tl.where`, `tl.math.erf`, …), never the `@triton.jit`
helpers of `triton.language.standard` (`tl.sigmoid`, `tl.sum`, `tl.zeros`): those are decorated when triton is first
imported, so they fail inside interpreted kernels when triton was imported before TRITON_INTERPRET was set.

Each lowering takes the dialect, the operands as source text (a value name such as `v3`, or a constant
already written as source) plus the op's keyword arguments, and returns one expression. Float math
runs in fp32 (inputs are upcast on load, results cast on store), as torch does inside its own kernels.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable

from fleetc.ops.activations import activation_call, activation_grad_call


class LoweringError(Exception):
    """An op (or an argument of it) that a fused kernel cannot express."""


class Dialect:
    """How a kernel language spells the expression builtins the lowerings use (Triton's spelling here).

    Float math is fp32 in every dialect; `num` writes a float literal of the kernel's float type, and
    `scaled_add` is `a + alpha * b` (`sign` "-" for `a - alpha * b`) as aten computes it.
    """

    name = "triton"

    def num(self, value: float) -> str:
        return repr(value)

    def constant(self, value: Any) -> str:
        """A Python constant from an op's arguments as source (infinities and NaN need a call)."""
        if isinstance(value, bool) or value is None:
            return repr(value)
        if isinstance(value, int):
            return repr(value)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f'float("{value!r}")'
        raise LoweringError(f"constant {value!r} of type {type(value).__name__} has no {self.name} form")

    def call(self, fn: str, *args: str) -> str:
        """One of exp, log, sqrt, rsqrt, abs, erf applied to source operands."""
        return f"{'tl.math.erf' if fn == 'erf' else 'tl.' + fn}({', '.join(args)})"

    def where(self, cond: str, a: str, b: str) -> str:
        return f"tl.where({cond}, ({a}), ({b}))"

    def tanh(self, x: str) -> str:
        return f"({self.num(2.0)} * {_sigmoid(self, f'{self.num(2.0)} * ({x})')} - {self.num(1.0)})"

    def scaled_add(self, a: str, b: str, alpha: str, sign: str) -> str:
        return f"(({a}) {sign} ({b}))" if alpha == "1" else f"(({a}) {sign} ({alpha}) * ({b}))"


class CDialect(Dialect):
    """C/C++ with fp32 `float` values: the prelude's inline exp, tanh and erf (fleetc/codegen/cpu/source.py), libm's
    log (vectorized through glibc's libmvec), float literals, and
    an explicit fma where aten's own build contracts `a + alpha * b` (so add/sub with alpha stay exact)."""

    name = "c"
    _CALLS = {"exp": "fc_exp", "log": "logf", "sqrt": "__builtin_sqrtf", "abs": "__builtin_fabsf", "erf": "fc_erf",
              "tanh": "fc_tanh"}

    def num(self, value: float) -> str:
        # the fp32 value aten would use (a double scalar cast to float), written so that reading it back is exact
        return f"{struct.unpack('f', struct.pack('f', value))[0]!r}f"

    def constant(self, value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            if math.isnan(value):
                return '__builtin_nanf("")'
            if math.isinf(value):
                return "__builtin_inff()" if value > 0 else "(-__builtin_inff())"
            return self.num(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return repr(value)
        raise LoweringError(f"constant {value!r} of type {type(value).__name__} has no C form")

    def call(self, fn: str, *args: str) -> str:
        if fn == "rsqrt":
            return f"({self.num(1.0)} / __builtin_sqrtf({args[0]}))"
        return f"{self._CALLS[fn]}({', '.join(args)})"

    def where(self, cond: str, a: str, b: str) -> str:
        return f"(({cond}) ? ({a}) : ({b}))"

    def tanh(self, x: str) -> str:
        return f"fc_tanh({x})"

    def scaled_add(self, a: str, b: str, alpha: str, sign: str) -> str:
        if alpha == "1":
            return f"(({a}) {sign} ({b}))"
        return f"__builtin_fmaf(({b}), {'-' if sign == '-' else ''}({alpha}), ({a}))"


TRITON = Dialect()
C = CDialect()


def constant(value: Any, dialect: Dialect = TRITON) -> str:
    """A Python constant as kernel source."""
    return dialect.constant(value)


def _sigmoid(d: Dialect, x: str) -> str:
    return f"({d.num(1.0)} / ({d.num(1.0)} + {d.call('exp', f'-({x})')}))"


def _gelu(d: Dialect, x: str, approximate: str = "'none'") -> str:
    if approximate == "'tanh'":
        inner = f"{d.num(math.sqrt(2 / math.pi))} * (({x}) + {d.num(0.044715)} * ({x}) * ({x}) * ({x}))"
        return f"({d.num(0.5)} * ({x}) * ({d.num(1.0)} + {d.tanh(inner)}))"
    if approximate != "'none'":
        raise LoweringError(f"gelu approximate={approximate}")
    return f"({d.num(0.5)} * ({x}) * ({d.num(1.0)} + {d.call('erf', f'({x}) * {d.num(math.sqrt(0.5))}')}))"


def _gelu_backward(d: Dialect, grad: str, x: str, approximate: str = "'none'") -> str:
    one = d.num(1.0)
    if approximate == "'tanh'":
        inner = f"{d.num(math.sqrt(2 / math.pi))} * (({x}) + {d.num(0.044715)} * ({x}) * ({x}) * ({x}))"
        t = d.tanh(inner)
        d_inner = f"{d.num(math.sqrt(2 / math.pi))} * ({one} + {d.num(3.0)} * {d.num(0.044715)} * ({x}) * ({x}))"
        return f"(({grad}) * ({d.num(0.5)} * ({one} + {t}) + {d.num(0.5)} * ({x}) * ({one} - {t} * {t}) * {d_inner}))"
    if approximate != "'none'":
        raise LoweringError(f"gelu_backward approximate={approximate}")
    cdf = f"({d.num(0.5)} * ({one} + {d.call('erf', f'({x}) * {d.num(math.sqrt(0.5))}')}))"
    pdf = f"({d.num(1 / math.sqrt(2 * math.pi))} * {d.call('exp', f'{d.num(-0.5)} * ({x}) * ({x})')})"
    return f"(({grad}) * ({cdf} + ({x}) * {pdf}))"


def _pow(d: Dialect, x: str, exponent: str) -> str:
    try:
        value = float(exponent.removesuffix("f"))
    except ValueError:
        raise LoweringError(f"pow with exponent {exponent}") from None
    forms = {2.0: f"(({x}) * ({x}))", 3.0: f"(({x}) * ({x}) * ({x}))", 0.5: d.call("sqrt", x),
             -0.5: d.call("rsqrt", x), -1.0: f"({d.num(1.0)} / ({x}))", 1.0: f"({x})"}
    if value not in forms:
        raise LoweringError(f"pow with exponent {exponent}")
    return forms[value]


def _with_alpha(sign: str) -> Callable[..., str]:
    def lower(d: Dialect, a: str, b: str, alpha: str = "1") -> str:
        return d.scaled_add(a, b, alpha, sign)

    return lower


def _binary(op: str) -> Callable[..., str]:
    return lambda d, a, b: f"(({a}) {op} ({b}))"


def _true_division(d: Dialect, a: str, b: str, rounding_mode: str = "None") -> str:
    if rounding_mode != "None":
        raise LoweringError(f"div rounding_mode={rounding_mode}")
    return f"(({a}) / ({b}))"


def _relu(d: Dialect, a: str) -> str:
    # aten's clamp_min(x, 0) is max(0, x) with x winning ties and NaN: relu(-0.0) = -0.0, relu(nan) = nan
    return d.where(f"{d.num(0.0)} > ({a})", d.num(0.0), a)


_LOWERINGS: dict[str, Callable[..., str]] = {
    "aten.add.Tensor": _with_alpha("+"),
    "aten.add.Scalar": _with_alpha("+"),
    "aten.sub.Tensor": _with_alpha("-"),
    "aten.sub.Scalar": _with_alpha("-"),
    "aten.rsub.Scalar": lambda d, a, b, alpha="1": d.scaled_add(b, a, alpha, "-"),
    "aten.mul.Tensor": _binary("*"),
    "aten.mul.Scalar": _binary("*"),
    "aten.div.Tensor": _true_division,
    "aten.div.Scalar": _true_division,
    "aten.neg.default": lambda d, a: f"(-({a}))",
    "aten.reciprocal.default": lambda d, a: f"({d.num(1.0)} / ({a}))",
    "aten.abs.default": lambda d, a: d.call("abs", a),
    "aten.exp.default": lambda d, a: d.call("exp", a),
    "aten.log.default": lambda d, a: d.call("log", a),
    "aten.sqrt.default": lambda d, a: d.call("sqrt", a),
    "aten.rsqrt.default": lambda d, a: d.call("rsqrt", a),
    "aten.pow.Tensor_Scalar": _pow,
    "aten.relu.default": _relu,
    "aten.threshold_backward.default": lambda d, g, x, t: d.where(f"({x}) <= ({t})", d.num(0.0), g),
    "aten.leaky_relu.default": lambda d, a, slope="0.01": d.where(f"({a}) > {d.num(0.0)}", a, f"({a}) * ({slope})"),
    "aten.leaky_relu_backward.default":
        lambda d, g, x, slope, self_is_result: d.where(f"({x}) > {d.num(0.0)}", g, f"({g}) * ({slope})"),
    "aten.sigmoid.default": _sigmoid,
    "aten.sigmoid_backward.default": lambda d, g, y: f"(({g}) * ({d.num(1.0)} - ({y})) * ({y}))",
    "aten.tanh.default": lambda d, a: d.tanh(a),
    "aten.tanh_backward.default": lambda d, g, y: f"(({g}) * ({d.num(1.0)} - ({y}) * ({y})))",
    "aten.silu.default": lambda d, a: f"(({a}) * {_sigmoid(d, a)})",
    "aten.silu_backward.default":
        lambda d, g, x: f"(({g}) * {_sigmoid(d, x)} * ({d.num(1.0)} + ({x}) * ({d.num(1.0)} - {_sigmoid(d, x)})))",
    "aten.gelu.default": _gelu,
    "aten.gelu_backward.default": _gelu_backward,
    # aten computes grad * mask * scale: a dropped element is grad * 0 (-0.0 for a negative grad, NaN for inf)
    "aten.native_dropout_backward.default":
        lambda d, g, mask, scale: d.where(mask, f"({g}) * ({scale})", f"({g}) * {d.num(0.0)}"),
    "aten.masked_fill.Scalar": lambda d, x, mask, value: d.where(mask, value, x),
    "aten.where.self": lambda d, cond, a, b: d.where(cond, a, b),
    "aten.bitwise_not.default": lambda d, a: f"(({a}) == 0)",
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


def lower(op_type: str, args: list[str], kwargs: dict[str, str], dialect: Dialect = TRITON) -> str:
    """The expression of one pointwise op in `dialect`; LoweringError when it has none."""
    if op_type not in _LOWERINGS:
        raise LoweringError(f"no lowering for {op_type}")
    try:
        return _LOWERINGS[op_type](dialect, *args, **kwargs)
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
    """Kernel source naming a value (not a string constant) inside an op call given as data."""


def source_text(value: Any, dialect: Dialect = TRITON) -> str:
    """An op argument as kernel source: an Operand as written, a string as its repr, else a constant."""
    if isinstance(value, Operand):
        return str(value)
    return repr(value) if isinstance(value, str) else dialect.constant(value)


def lower_call(op_type: str, args: tuple, kwargs: tuple, dialect: Dialect = TRITON) -> str:
    """The expression of an op call given as data: Operand arguments are values, the rest constants."""
    return lower(op_type, [source_text(a, dialect) for a in args], {k: source_text(v, dialect) for k, v in kwargs},
                 dialect)


def activation_expression(act_name: str, param: Any, x: str, dialect: Dialect = TRITON) -> str:
    """The expression of an activation of the value `x`, lowered as the captured op is."""
    return lower_call(*activation_call(act_name, Operand(x), param), dialect)


def activation_grad_expression(act_name: str, param: Any, grad: str, saved: str, dialect: Dialect = TRITON) -> str:
    """The expression of an activation's gradient from `grad` and the value its grad op saves."""
    return lower_call(*activation_grad_call(act_name, Operand(grad), Operand(saved), param), dialect)
