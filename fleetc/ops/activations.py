"""The activations fused ops may end with: how each appears in a captured Program and its aten semantics.

One table serves every fusion family (elementwise add+act, batch norm+act, gemm epilogue): the passes
use it to recognise an activation op and its gradient op, the fused ops' references use it to compute
them, and `pointwise` gives each a small declarative expression (in `x`, `param`; `y` is the result,
`g` the incoming gradient) that a kernel generator can turn into code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Activation:
    """An activation: forward/grad op types in the Program, references, and what its grad op saves.

    `saves` is "input" or "output": which forward value the captured gradient op reads (None: neither).
    `param` is the activation's one constant (gelu's approximate, leaky_relu's slope, scale's factor).
    """

    name: str
    op_type: str
    grad_type: str
    saves: str | None
    forward: Callable[[torch.Tensor, Any], torch.Tensor]
    grad: Callable[[torch.Tensor, torch.Tensor | None, Any], torch.Tensor]
    pointwise: str
    pointwise_grad: str


ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", "aten.relu.default", "aten.threshold_backward.default", "output",
               lambda x, p: aten.relu.default(x), lambda g, y, p: aten.threshold_backward.default(g, y, 0),
               "max(x, 0)", "where(y <= 0, 0, g)"),
    Activation("gelu", "aten.gelu.default", "aten.gelu_backward.default", "input",
               lambda x, p: aten.gelu.default(x, approximate=p), lambda g, x, p: aten.gelu_backward.default(g, x, approximate=p),
               "0.5 * x * (1 + erf(x / sqrt(2)))  if param == 'none' else "
               "0.5 * x * (1 + t), t = tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))",
               "g * (0.5 * (1 + erf(x / sqrt(2))) + x * exp(-x * x / 2) / sqrt(2 * pi))  if param == 'none' else "
               "g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * sqrt(2 / pi) * (1 + 3 * 0.044715 * x**2))"),
    Activation("silu", "aten.silu.default", "aten.silu_backward.default", "input",
               lambda x, p: aten.silu.default(x), lambda g, x, p: aten.silu_backward.default(g, x),
               "x * sigmoid(x)", "g * sigmoid(x) * (1 + x * (1 - sigmoid(x)))"),
    Activation("sigmoid", "aten.sigmoid.default", "aten.sigmoid_backward.default", "output",
               lambda x, p: aten.sigmoid.default(x), lambda g, y, p: aten.sigmoid_backward.default(g, y),
               "1 / (1 + exp(-x))", "g * y * (1 - y)"),
    Activation("tanh", "aten.tanh.default", "aten.tanh_backward.default", "output",
               lambda x, p: aten.tanh.default(x), lambda g, y, p: aten.tanh_backward.default(g, y),
               "tanh(x)", "g * (1 - y * y)"),
    Activation("leaky_relu", "aten.leaky_relu.default", "aten.leaky_relu_backward.default", "input",
               lambda x, p: aten.leaky_relu.default(x, p), lambda g, x, p: aten.leaky_relu_backward.default(g, x, p, False),
               "where(x > 0, x, x * param)", "where(x > 0, g, g * param)"),
    Activation("scale", "aten.mul.Tensor", "aten.mul.Tensor", None,
               lambda x, p: aten.mul.Tensor(x, p), lambda g, _, p: aten.mul.Tensor(g, p),
               "x * param", "g * param"),
)}
_BY_OP_TYPE = {a.op_type: a for a in ACTIVATIONS.values()}


def match_activation(op_type: str, args: tuple, kwargs: dict) -> tuple[Activation, Any] | None:
    """(activation, its constant) when an op is a recognised activation of one tensor, else None."""
    act = _BY_OP_TYPE.get(op_type)
    if act is None or not args:
        return None
    if act.name == "gelu":
        return act, kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    if act.name == "leaky_relu":
        return act, args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
    if act.name == "scale":
        # only x * python-number is a scale; x * tensor is an ordinary product
        return (act, args[1]) if len(args) == 2 and isinstance(args[1], (int, float)) and not kwargs else None
    return (act, None) if len(args) == 1 and not kwargs else None


def grad_saved_arg(act: Activation, grad_op_args: tuple) -> Any:
    """The argument of a captured gradient op that holds the saved forward value (None for scale)."""
    return grad_op_args[1] if act.saves else None


def is_grad_op(act: Activation, param: Any, op_type: str, args: tuple, kwargs: dict) -> bool:
    """Whether a captured op computes `act`'s gradient with the same constant."""
    if op_type != act.grad_type:
        return False
    if act.name == "relu":
        return len(args) == 3 and args[2] == 0
    if act.name == "gelu":
        return kwargs.get("approximate", args[2] if len(args) > 2 else "none") == param
    if act.name == "leaky_relu":
        return len(args) == 4 and args[2] == param and args[3] is False
    if act.name == "scale":
        return len(args) == 2 and args[1] == param
    return True


def apply(act_name: str, x: torch.Tensor, param: Any) -> torch.Tensor:
    return ACTIVATIONS[act_name].forward(x, param)


def apply_grad(act_name: str, grad: torch.Tensor, saved: torch.Tensor | None, param: Any) -> torch.Tensor:
    return ACTIVATIONS[act_name].grad(grad, saved, param)


def activation_call(act_name: str, x: Any, param: Any) -> tuple[str, tuple, tuple]:
    """(op type, args, kwargs pairs) of `act(x)` as a captured Program writes it (see match_activation)."""
    op_type = ACTIVATIONS[act_name].op_type
    if act_name == "gelu":
        return op_type, (x,), (("approximate", param),)
    if act_name in ("leaky_relu", "scale"):
        return op_type, (x, param), ()
    return op_type, (x,), ()


def activation_grad_call(act_name: str, grad: Any, saved: Any, param: Any) -> tuple[str, tuple, tuple]:
    """(op type, args, kwargs pairs) of `act`'s gradient op as a captured Program writes it (see is_grad_op)."""
    op_type = ACTIVATIONS[act_name].grad_type
    if act_name == "relu":
        return op_type, (grad, saved, 0), ()
    if act_name == "gelu":
        return op_type, (grad, saved), (("approximate", param),)
    if act_name == "leaky_relu":
        return op_type, (grad, saved, param, False), ()
    if act_name == "scale":
        return op_type, (grad, param), ()
    return op_type, (grad, saved), ()
