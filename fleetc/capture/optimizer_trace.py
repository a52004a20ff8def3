"""Traces one parameter's update by a torch.optim optimizer into an aten FX graph with symbolic hyperparameters.

The optimizer's own `step()` runs under `make_fx` on a shadow of the optimizer holding one fake
parameter, its fake gradient and its fake state, with `foreach`/`fused` off, so torch dispatches to
the optimizer's functional single-tensor update. Every float hyperparameter of the param group (lr,
betas, momentum, eps, weight decay, ...) is a symbolic float: the graph reads it as an input and
does its Python arithmetic (`1 - beta1`) as scalar nodes, so a scheduler changing it needs no new
trace. Where the update branches on a hyperparameter (`if weight_decay != 0`), the branch taken is
recorded as a guard on the symbol's sign (`TracedUpdate.guarded`); fleetc keys its Program cache
on those hyperparameters' signs (`hyperparameter_signs`) and refuses an update that branches on
anything else.
"""
from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from fleetc.capture.optimizer_state import StateSlot, shadow_optimizer
from fleetc.errors import UnsupportedOptimizerError

def _is_hyper_value(value: Any) -> bool:
    if type(value) is float:
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def group_hyperparameters(group: dict[str, Any]) -> dict[str, float]:
    """Every float entry of a param group (tuple entries as `betas.0`, `betas.1`) → its current value."""
    found = {}
    for key, value in group.items():
        if key == "params":
            continue
        if _is_hyper_value(value):
            found[key] = float(value)
        elif isinstance(value, (tuple, list)):
            found.update({f"{key}.{i}": float(v) for i, v in enumerate(value) if _is_hyper_value(v)})
    return found


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def hyperparameter_signs(group: dict[str, Any], guarded: frozenset[str]) -> tuple:
    """What an update of this group was compiled for: the values of its non-float entries and the signs of the
    `guarded` hyperparameters (those an update branches on). Other float entries are fed, or unused (a
    scheduler's `initial_lr`), so they are left out."""
    hypers = group_hyperparameters(group)

    def part(name: str, value: Any) -> Any:
        if name not in hypers:
            return repr(value)
        return _sign(hypers[name]) if name in guarded else None

    parts = []
    for key, value in sorted(group.items()):
        if key == "params":
            continue
        described = (tuple(part(f"{key}.{i}", v) for i, v in enumerate(value)) if isinstance(value, (tuple, list))
                     else part(key, value))
        if described is not None:
            parts.append((key, described))
    return tuple(parts)


@dataclass
class TracedUpdate:
    """The update graph of one parameter. Placeholders, in order: the parameter, its gradient, its state
    tensors (in `state_keys` order) and the hyperparameters (in `hyper_keys` order). The graph returns the
    new tensors of the state entries the step replaced rather than updated in place (`reassigned`); the
    module holds the tensor constants its `get_attr` nodes name."""

    module: torch.fx.GraphModule
    state_keys: tuple[str, ...]
    hyper_keys: tuple[str, ...]
    reassigned: tuple[str, ...]
    guarded: frozenset[str]


def _group_with(group: dict[str, Any], symbols: dict[str, Any], capturable: bool) -> dict[str, Any]:
    """`group` with each hyperparameter replaced by its symbol and the implementation flags set for tracing."""
    out = dict(group)
    for key, value in group.items():
        if key in symbols:
            out[key] = symbols[key]
        elif isinstance(value, (tuple, list)) and any(f"{key}.{i}" in symbols for i in range(len(value))):
            out[key] = type(value)(symbols.get(f"{key}.{i}", v) for i, v in enumerate(value))
    flags = {"foreach": False, "fused": False, "capturable": capturable}
    out.update({flag: setting for flag, setting in flags.items() if flag in group})
    return out


def traceable_step(optimizer: torch.optim.Optimizer) -> Any:
    """The class's `step` without torch's hook-and-profiler wrapper (step hooks are not part of the update)."""
    step = type(optimizer).step
    inner = step.__wrapped__ if getattr(step, "hooked", False) else step
    closure = inspect.signature(inner).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step(closure) needs a closure that re-evaluates the model and loss, "
            "possibly several times per step; fleetc compiles exactly one forward, backward and update per step, "
            "so it cannot capture this optimizer. Use a single-step optimizer (SGD, Adam, ...)")
    return inner


def _is_sign_condition(expr: Any) -> bool:
    """`x != 0`, `x > 0`, `x <= 0`, ...: a comparison of one symbol with zero."""
    if not isinstance(expr, sympy.core.relational.Relational) or len(expr.free_symbols) != 1:
        return False
    sides = (expr.lhs, expr.rhs)
    return next(iter(expr.free_symbols)) in sides and any(side.is_zero for side in sides)


def _sign_guards(optimizer: torch.optim.Optimizer, guards: list, names: dict[sympy.Symbol, str]) -> frozenset[str]:
    """The hyperparameters whose signs the update branched on; any other condition is refused."""
    guarded = set()
    for expr in guards:
        if _is_sign_condition(expr):
            guarded.add(names[next(iter(expr.free_symbols))])
            continue
        readable = str(expr)
        for symbol, name in names.items():
            readable = readable.replace(str(symbol), name)
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}'s update branches on `{readable}`, a condition on hyperparameter values "
            "beyond their signs; fleetc feeds hyperparameters at run time and can only specialize on their signs")
    return frozenset(guarded)


def trace_update(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor,
                 layout: tuple[StateSlot, ...]) -> TracedUpdate:
    """Trace `optimizer`'s update of one parameter shaped like `param` whose state has `layout`.

    On CPU the update is first traced as eager torch runs it (`capturable=False`: the step count read
    back as a host number, bias corrections in double precision), so it matches eager torch bit for bit.
    Where that branches on the step count (RAdam) or on other devices, it is traced with
    `capturable=True`: all arithmetic stays in tensors, with no host synchronisation.
    """
    step = traceable_step(optimizer)
    if group.get("differentiable"):
        raise UnsupportedOptimizerError(f"{type(optimizer).__name__} has differentiable=True (updates that autograd "
                                        "can differentiate through); fleetc runs the update outside autograd")
    if param.is_complex():
        raise UnsupportedOptimizerError("complex parameters are not supported by fleetc's optimizer capture")
    if param.device.type == "cpu":
        try:
            return _trace(optimizer, step, group, param, layout, capturable=False)
        except UnsupportedOptimizerError as exc:
            if not isinstance(exc.__cause__, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode):
                raise
    return _trace(optimizer, step, group, param, layout, capturable=True)


def _trace(optimizer: torch.optim.Optimizer, step: Any, group: dict[str, Any], param: torch.Tensor,
           layout: tuple[StateSlot, ...], capturable: bool) -> TracedUpdate:
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    hypers = group_hyperparameters(group)
    symbols, names = {}, {}
    for name, value in hypers.items():
        symbol = shape_env.create_unspecified_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        symbols[name] = shape_env.create_symfloatnode(symbol, hint=value, source=ConstantSource(name))
        names[symbol] = name
    with mode:
        fake_param = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        fake_grad = torch.empty_like(fake_param)
        fake_state = [torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=s.device) for s in layout]
    keys = tuple(s.key for s in layout)
    reassigned: list[str] = []

    def update(p: torch.Tensor, g: torch.Tensor, state: list, hyper_values: list) -> list:
        state_dict: defaultdict = defaultdict(dict)
        state_dict[p] = dict(zip(keys, state))
        shadow = shadow_optimizer(optimizer, _group_with(group, dict(zip(hypers, hyper_values)), capturable)
                                  | {"params": [p]}, state_dict)
        p.grad = g
        step(shadow)
        final = state_dict[p]
        if set(final) != set(keys):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}'s step creates state {sorted(set(final) - set(keys))} inside the update "
                "(not in _init_group), so its first step and later steps differ; fleetc cannot trace one update")
        reassigned.extend(k for k, old in zip(keys, state) if final[k] is not old)
        return [final[k] for k in reassigned]

    # With capturable, torch.optim skips its device check only while compiling (and keeps step counts as tensors).
    session = torch.compiler._compile_session_context() if capturable else contextlib.nullcontext()
    try:
        with session:
            gm = make_fx(update, tracing_mode="symbolic")(fake_param, fake_grad, fake_state, list(symbols.values()))
    except UnsupportedOptimizerError:
        raise
    except Exception as exc:  # torch raises many unrelated types; all mean the update could not be traced
        raise UnsupportedOptimizerError(
            f"cannot trace {type(optimizer).__name__}'s update: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:300]} (its Python code probably branches on a tensor value, "
            "such as the step count)") from exc
    guarded = _sign_guards(optimizer, [g.expr for g in shape_env.guards], names)
    return TracedUpdate(gm, keys, tuple(hypers), tuple(reassigned), guarded)
