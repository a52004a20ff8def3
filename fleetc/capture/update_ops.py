"""Turns a traced update graph (optimizer_trace.py) into one parameter's optimize-role ops in a Program.

Placeholders become the parameter, its gradient, its state Vars and the param group's HYPER feeds.
An in-place aten op on the parameter or a state tensor stays in place and names that persistable as
its output (its schema says it writes it, which the verifier checks); an in-place op on a temporary
becomes its out-of-place overload, so every temporary has one definer. Python arithmetic on
hyperparameters becomes `fleetc.scalar_*` ops and `.item()` becomes `fleetc.item`. State the step
replaced rather than updated is copied back with `fleetc.assign`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fleetc.capture.fx_args import map_node_args
from fleetc.capture.optimizer_trace import TracedUpdate
from fleetc.errors import UnsupportedOptimizerError
from fleetc.ir.liveness import aliased_input, written_arguments
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ops.scalar import SCALAR_OPS

ITEM = torch.ops.aten._local_scalar_dense.default


def _scalar_var(name: str, value: Any) -> Var:
    if isinstance(value, (bool, torch.SymBool)):
        return Var(name, None, "bool", "cpu")
    if isinstance(value, (int, torch.SymInt)):
        return Var(name, None, "int64", "cpu")
    return Var(name, None, "float64", "cpu")


def _var_like(name: str, value: Any) -> Var:
    if isinstance(value, torch.Tensor):
        return Var(name, tuple(int(d) for d in value.shape), str(value.dtype).removeprefix("torch."),
                   str(value.device))
    return _scalar_var(name, value)


def _out_of_place(overload: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.add_.Tensor` → `aten.add.Tensor`, `aten.maximum.out` → `aten.maximum.default` (None if none)."""
    name, overload_name = overload._schema.name.split("::")[1], overload._overloadname
    if name.endswith("_"):
        candidate = (name[:-1], overload_name)
    elif overload_name == "out":
        candidate = (name, "default")
    else:
        return None
    packet = getattr(torch.ops.aten, candidate[0], None)
    functional = getattr(packet, candidate[1], None) if packet is not None else None
    if functional is None or written_arguments(str(functional)):
        return None
    return functional


class UpdateBuilder:
    """Appends parameters' updates to a Program, naming each op and temporary `<param>.<node>`."""

    def __init__(self, program: Program):
        self.program = program
        self.taken = {v.name for v in program.all_vars()} | {op.name for _, op in program.walk_ops()}

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def build(self, traced: TracedUpdate, param: str, grad: str, state: dict[str, str], hypers: Callable[[str], str],
              attrs: dict[str, Any]) -> list[Op]:
        """The ops of one parameter's update; `hypers(key)` gives the HYPER Var of a hyperparameter (created on
        first use, so only those the update reads are fed)."""
        persistable = {param, *state.values()}
        self.view_of: dict[str, str] = {}  # temporary view → the persistable it aliases
        env: dict[torch.fx.Node, Any] = {}
        ops: list[Op] = []
        graph = traced.module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        tensors = [param, grad, *(state[k] for k in traced.state_keys)]
        for node, name in zip(placeholders, tensors):
            env[node] = Ref(name)
        for node, key in zip(placeholders[len(tensors):], traced.hyper_keys):
            env[node] = Ref(hypers(key)) if node.users else None

        def arg(value: Any) -> Any:
            return map_node_args(value, env.__getitem__)

        for node in graph.nodes:
            if node.op == "get_attr":
                ops.append(self._constant(node, getattr(traced.module, node.target), param, attrs))
                env[node] = Ref(ops[-1].outputs[0])
            elif node.op == "call_function":
                op = self._op(node, [arg(a) for a in node.args], {k: arg(v) for k, v in node.kwargs.items()},
                              param, persistable, attrs)
                env[node] = Ref(op.outputs[0])
                ops.append(op)
            elif node.op == "output":
                for key, value in zip(traced.reassigned, node.args[0]):
                    ops.append(Op(self.fresh(f"{param}.assign_{key}"), "fleetc.assign", (Ref(state[key]), arg(value)),
                                  outputs=[state[key]], attrs=dict(attrs)))
        return ops

    def _op(self, node: torch.fx.Node, args: list, kwargs: dict, param: str, persistable: set[str],
            attrs: dict[str, Any]) -> Op:
        target, value = node.target, node.meta.get("val")
        if target in SCALAR_OPS or target is ITEM:
            op_type = "fleetc.item" if target is ITEM else f"fleetc.{SCALAR_OPS[target]}"
            return self._new(node, op_type, args, kwargs, param, _scalar_var("", value), attrs)
        if not isinstance(target, torch._ops.OpOverload):
            raise UnsupportedOptimizerError(f"the traced update calls {target!r}, which fleetc cannot put in a Program")
        written = written_arguments(str(target))
        if not written:
            op = self._new(node, str(target), args, kwargs, param, _var_like("", value), attrs)
            base = aliased_input(op, 0)
            if base in persistable or base in self.view_of:
                self.view_of[op.outputs[0]] = self.view_of.get(base, base)
            return op
        position, name, keyword = written[0]
        destination = kwargs.get(name) if keyword else args[position]
        if len(written) == 1 and isinstance(destination, Ref) and destination.name in persistable:
            return Op(self.fresh(f"{param}.{node.name}"), str(target), tuple(args), kwargs, outputs=[destination.name],
                      attrs=dict(attrs))
        if isinstance(destination, Ref) and destination.name in self.view_of:
            raise UnsupportedOptimizerError(f"the traced update writes {self.view_of[destination.name]!r} through a "
                                            f"view with {target}; fleetc updates a parameter or its state only directly, not through a view")
        functional = _out_of_place(target)
        if functional is not None:
            if keyword:
                kwargs = {k: v for k, v in kwargs.items() if k != name}
            return self._new(node, str(functional), args, kwargs, param, _var_like("", value), attrs)
        raise UnsupportedOptimizerError(f"the traced update writes a temporary with {target}, which has no "
                                        "out-of-place form")

    def _constant(self, node: torch.fx.Node, value: torch.Tensor, param: str, attrs: dict[str, Any]) -> Op:
        """A literal the update turned into a tensor (`grad[mask] = 0`), made by an op: Programs hold no tensors."""
        if value.dim() != 0:
            raise UnsupportedOptimizerError(f"the traced update uses a constant tensor of shape {tuple(value.shape)}; "
                                            "fleetc only carries scalar constants")
        return self._new(node, "aten.scalar_tensor.default", [value.item()],
                         {"dtype": value.dtype, "device": value.device}, param, _var_like("", value), attrs)

    def _new(self, node: torch.fx.Node, op_type: str, args: list, kwargs: dict, param: str, like: Var,
             attrs: dict[str, Any]) -> Op:
        name = self.fresh(f"{param}.{node.name}")
        self.program.global_block.add_var(Var(name, like.shape, like.dtype, like.device, VarKind.TEMP))
        return Op(name, op_type, tuple(args), kwargs, outputs=[name], attrs=dict(attrs))


def update_attrs(param: str) -> dict[str, Any]:
    """The standard attributes of an op in `param`'s update."""
    return {"op_role": int(OpRole.OPTIMIZE), "module_path": param.rpartition(".")[0], "param": param}
