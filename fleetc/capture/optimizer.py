"""Lowers a torch.optim optimizer into optimize-role ops appended to a training Program, one update per parameter.

Any single-step torch.optim optimizer is captured by tracing its own single-tensor update
(optimizer_trace.py → update_ops.py). SGD, Adam and AdamW (without amsgrad) have hand-written fast
paths, `fleetc.sgd` / `fleetc.adam`, which `fuse_all_optimizer_ops` turns into multi-tensor updates.

State tensors are named `<param>@<torch state key>` (e.g. `fc.weight@exp_avg`) and recorded in
`program.metadata["state_bindings"]`, so the runtime binds them to the user's `optimizer.state`.
Float hyperparameters are HYPER Vars fed every step (`lr@group0`, `betas.0@group0`, ...): schedulers
that change them need no recompile. Where an update branches on one's sign (SGD's momentum buffer
exists only with momentum != 0; torch's `if weight_decay != 0`), `metadata["optimizer"]["guarded"]`
names it and the cache key holds its sign (`OptimizerSignature`). Int settings are constants in the
key. `program.metadata["optimizer"]["feeds"]` says where each fed value comes from, for the runtime
(runtime/hyperparameters.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from fleetc.capture.optimizer_state import StateSlot, state_layout
from fleetc.capture.optimizer_trace import (
    TracedUpdate,
    group_hyperparameters,
    hyperparameter_signs,
    trace_update,
    traceable_step,
)
from fleetc.capture.update_ops import UpdateBuilder, update_attrs
from fleetc.errors import UnsupportedOptimizerError
from fleetc.ir.program import Op, Program, Ref, Var, VarKind

# Optimizer classes with a hand-written update op, used unless an option needs the traced update.
_HAND_WRITTEN = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_use_hand_written = True


@contextlib.contextmanager
def traced_updates_only() -> Iterator[None]:
    """Capture even SGD / Adam / AdamW by tracing (for benchmarks and tests of the traced path)."""
    global _use_hand_written
    saved, _use_hand_written = _use_hand_written, False
    try:
        yield
    finally:
        _use_hand_written = saved


class OptimizerSignature:
    """The optimizer's part of the Program cache key: its class, every param group's size and non-float
    settings, and the signs of the hyperparameters some captured update branched on (learned from the
    Programs compiled so far; every other float hyperparameter is fed, so its value never recompiles)."""

    def __init__(self) -> None:
        self.guarded: frozenset[str] = frozenset()

    def __call__(self, optimizer: torch.optim.Optimizer) -> tuple[tuple[str, Any], ...]:
        """The key's parts, each named by what changed when it differs."""
        groups = optimizer.param_groups
        return (("the optimizer's class", type(optimizer).__qualname__),
                ("param group sizes", tuple(len(group["params"]) for group in groups)),
                ("the sign of a hyperparameter an update branches on",
                 tuple(hyperparameter_signs(group, self.guarded) for group in groups)))

    def learn(self, program: Program) -> None:
        """Add the hyperparameters `program`'s updates branched on."""
        self.guarded |= frozenset(program.metadata.get("optimizer", {}).get("guarded", ()))


def _hand_written_kind(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    kind = _HAND_WRITTEN.get(type(optimizer)) if _use_hand_written else None
    if kind == "adam" and group.get("amsgrad"):
        return None  # the hand-written op has no max_exp_avg_sq
    return kind


class _Lowering:
    """State, hyperparameter and feed bookkeeping while one optimizer is lowered."""

    def __init__(self, program: Program, optimizer: torch.optim.Optimizer):
        self.program = program
        self.optimizer = optimizer
        self.builder = UpdateBuilder(program)
        self.feeds: list[dict[str, Any]] = []
        self.traces: dict[tuple, TracedUpdate] = {}
        self.counts = {"hand_written": 0, "traced": 0}
        self.guarded: set[str] = set()  # hyperparameters an update branches on (their signs are compiled in)
        program.metadata.setdefault("state_bindings", {})

    def feed(self, name: str, dtype: str, spec: dict[str, Any]) -> str:
        if self.program.find_var(name) is None:
            self.program.global_block.add_var(Var(name, None, dtype, "cpu", VarKind.HYPER))
            self.program.feeds.append(name)
            self.feeds.append({"var": name, **spec})
        return name

    def hyper(self, group_index: int, key: str) -> str:
        """The HYPER Var of a param group's hyperparameter (`lr`, `betas.0`), created on first use."""
        base, _, index = key.partition(".")
        spec = {"group": group_index, "key": base, **({"index": int(index)} if index else {})}
        return self.feed(f"{key}@group{group_index}", "float64", spec)

    def hyper_or_constant(self, group_index: int, group: dict[str, Any], key: str) -> Ref | float:
        """A fed float hyperparameter, or the constant value of an int one (its value is in the cache key)."""
        if key in group_hyperparameters(group):
            return Ref(self.hyper(group_index, key))
        base, _, index = key.partition(".")
        return float(group[base][int(index)] if index else group[base])

    def state_var(self, param: Var, slot: StateSlot) -> str:
        name = f"{param.name}@{slot.key}"
        self.program.global_block.add_var(Var(name, slot.shape, slot.dtype, slot.device, VarKind.OPTIMIZER_STATE))
        self.program.metadata["state_bindings"][name] = [param.name, slot.key]
        return name

    # ----- updates ---------------------------------------------------------------------------------
    def hand_written(self, kind: str, gi: int, group: dict[str, Any], param: Var, grad: str) -> Op:
        hyper = lambda key: self.hyper_or_constant(gi, group, key)  # noqa: E731
        lr = Ref(self.hyper(gi, "lr"))
        attrs = update_attrs(param.name)
        name = param.name
        if kind == "sgd":
            momentum = group["momentum"]
            if "momentum" in group_hyperparameters(group):
                self.guarded.add("momentum")  # the buffer exists only with momentum != 0
            buf = Ref(self.state_var(param, StateSlot("momentum_buffer", param.shape, param.dtype, param.device))) \
                if momentum else None
            fresh = Ref(self.feed(f"{name}@momentum_fresh", "bool", {"param": name, "absent": "momentum_buffer"})) \
                if momentum else False
            return Op(f"{name}.sgd", "fleetc.sgd",
                      (Ref(name), Ref(grad), buf, fresh, lr, hyper("momentum") if momentum else 0.0,
                       hyper("dampening") if momentum else 0.0, bool(group["nesterov"]), hyper("weight_decay"),
                       bool(group["maximize"])),
                      outputs=[name] + ([buf.name] if buf else []), attrs=attrs)
        states = [self.state_var(param, StateSlot(key, param.shape, param.dtype, param.device))
                  for key in ("exp_avg", "exp_avg_sq")]
        step = self.state_var(param, StateSlot("step", (), "float32", param.device))
        decoupled = type(self.optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
        return Op(f"{name}.{type(self.optimizer).__name__.lower()}", "fleetc.adam",
                  (Ref(name), Ref(grad), *map(Ref, states), Ref(step), lr, hyper("betas.0"), hyper("betas.1"),
                   hyper("eps"), hyper("weight_decay"), decoupled, bool(group["maximize"])),
                  outputs=[name, *states, step], attrs=attrs)

    def traced(self, gi: int, group: dict[str, Any], tensor: torch.Tensor, param: Var, grad: str) -> list[Op]:
        traceable_step(self.optimizer)  # refuse closure optimizers before looking at their state
        layout = state_layout(self.optimizer, group, tensor)
        key = (gi, tuple(tensor.shape), tensor.dtype, str(tensor.device), layout)
        if key not in self.traces:
            self.traces[key] = trace_update(self.optimizer, group, tensor, layout)
        state = {slot.key: self.state_var(param, slot) for slot in layout}
        self.guarded |= self.traces[key].guarded
        return self.builder.build(self.traces[key], param.name, grad, state, lambda k: self.hyper(gi, k),
                                  update_attrs(param.name))


def lower_optimizer(program: Program, optimizer: torch.optim.Optimizer, param_names: dict[int, str]) -> None:
    """Append each parameter's update (for those with a gradient); gradients stop being fetched."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    kind = type(optimizer).__name__
    lowering = _Lowering(program, optimizer)
    grads: dict[str, str] = {}  # parameter → the gradient its update reads
    for gi, group in enumerate(optimizer.param_groups):
        for tensor in group["params"]:
            if id(tensor) not in param_names:
                raise UnsupportedOptimizerError(
                    f"{kind} param_groups[{gi}] holds a tensor of shape {tuple(tensor.shape)} that is not a "
                    "parameter of the compiled model")
            name = param_names[id(tensor)]
            grad = program.fetches.pop(f"grad:{name}", None)
            if grad is None:
                continue  # no gradient reaches it: torch.optim skips such params too
            grads[name] = grad
            param = program.var(name)
            hand_written = _hand_written_kind(optimizer, group)
            if hand_written is not None:
                if group.get("differentiable"):
                    raise UnsupportedOptimizerError(f"{kind} param_groups[{gi}] sets differentiable=True, which "
                                                    "fleetc does not lower (the update runs outside autograd)")
                program.global_block.ops.append(lowering.hand_written(hand_written, gi, group, param, grad))
            else:
                program.global_block.ops.extend(lowering.traced(gi, group, tensor, param, grad))
            lowering.counts["hand_written" if hand_written else "traced"] += 1
    program.metadata["optimizer"] = {"type": kind, "grads": grads, "feeds": lowering.feeds,
                                     "guarded": sorted(lowering.guarded), **lowering.counts}
