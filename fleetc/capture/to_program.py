"""Converts a traced aten FX graph (with AOTAutograd descriptors) into a Program."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)

from fleetc.capture.fp16_guard import ATTR as FP16_GUARD
from fleetc.capture.fx_args import map_node_args
from fleetc.capture.dynamic import SymbolTable
from fleetc.capture.step_module import MODEL_ATTR
from fleetc.capture.trace import user_frame_from_stack_trace
from fleetc.errors import CaptureError
from fleetc.ir.constants import add_constant
from fleetc.ir.program import Op, OpRole, Program, Ref, Var, VarKind
from fleetc.ir.usedef import Names
from fleetc.ops.scalar import SCALAR_OPS

LOSS_VAR = "loss"
OUTPUT_VAR = "output"
INPUT_GRAD_FETCH = "input_grad:"  # fetch key prefix of a step input's gradient (an input with requires_grad)


# Ops that return nothing and only check, at run time, what the trace already fixed: a tensor's dtype/device/shape
# after `.to(...)` (`_assert_tensor_metadata`) or a symbolic-shape condition. The Program is specialised to the
# traced shapes and dtypes and its guards recheck them each step (docs/guards.md), so capture drops these checks
# (counted in `metadata["dropped_checks"]`). Any other op without a result raises CaptureError.
CHECK_OPS = frozenset({
    "aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten._assert_async.default",
    "aten._assert_async.msg", "aten.sym_constrain_range.default", "aten.sym_constrain_range_for_size.default",
})


def grad_name(param: str) -> str:
    return f"{param}@GRAD"


def _strip_model_prefix(path: str) -> str:
    """`model.layers.0.fc` → `layers.0.fc`; paths outside the model (the loss function) → ``."""
    if path == MODEL_ATTR:
        return ""
    if path.startswith(MODEL_ATTR + "."):
        return path[len(MODEL_ATTR) + 1:]
    return path


def _raw_module_path(node: torch.fx.Node, backward: bool) -> str | None:
    """The innermost module path the node was traced in, as torch recorded it (None: outside any module)."""
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def _var_from_value(name: str, value: Any, kind: VarKind, symbols: SymbolTable | None = None) -> Var:
    if isinstance(value, torch.Tensor):
        shape = tuple(symbols.expr(d) if symbols else int(d) for d in value.shape)
        return Var(name, shape, str(value.dtype).removeprefix("torch."), str(value.device), kind)
    if isinstance(value, (bool, torch.SymBool)):
        return Var(name, None, "bool", "cpu", kind)
    if isinstance(value, (int, torch.SymInt)):
        return Var(name, None, "int64", "cpu", kind)
    if isinstance(value, (float, torch.SymFloat)):
        return Var(name, None, "float64", "cpu", kind)
    raise CaptureError(f"value {name!r} of type {type(value).__name__} cannot be a Program variable")


def rename_temporaries(program: Program, mapping: dict[str, str]) -> None:
    """Rename Vars of the global block everywhere they appear (definitions, readers, fetches), in one pass over the
    ops: a pass per name grows quadratically with the step."""
    if not mapping:
        return
    block = program.global_block
    for old, new in mapping.items():
        var = block.vars.pop(old)
        var.name = new
        block.vars[new] = var
    for op in block.ops:
        op.rename_inputs(mapping)
        op.outputs = [mapping.get(o, o) for o in op.outputs]
    program.fetches = {key: mapping.get(name, name) for key, name in program.fetches.items()}


def _not_an_operator(node: torch.fx.Node) -> CaptureError:
    """The CaptureError for a graph call that is no operator: a higher-order op (torch.cond, torch.while_loop, ...)
    or a Python function; it names the construct and the user's file:line."""
    name = getattr(node.target, "__name__", str(node.target))
    source = user_frame_from_stack_trace(node.meta.get("stack_trace")) or "an unknown location"
    return CaptureError(f"cannot capture {name!r} at {source}: a higher-order op or Python function, which a Program "
                        "cannot hold as one operator\n  hint: compute both branches and pick with torch.where, or "
                        "register the function as a custom operator (torch.library.custom_op)")


class _Converter:
    """One pass over the FX graph, building the Program's global block."""

    def __init__(self, gm: torch.fx.GraphModule, feed_names: list[str], wrapped: bool, loss_ops: bool,
                 canonical: dict[str, str], symbols: SymbolTable | None = None):
        self.gm = gm
        self.symbols = symbols  # a symbolic trace's shape symbols, renamed for the Program
        self.canonical = canonical  # tied weights: every alias → the name named_parameters() reports
        self.feed_names = feed_names
        self.wrapped = wrapped  # graph of a TrainStep: names carry the `model.` prefix
        self.loss_ops = loss_ops  # ops outside the model are the loss function's (marked LOSS)
        self.program = Program()
        self.block = self.program.global_block
        self.env: dict[torch.fx.Node, Any] = {}  # node → Ref, or a list of Refs for tuple results
        self.seq_to_forward: dict[int, list[Op]] = {}
        self.renames: dict[str, str] = {}  # temporaries bound to result names, applied by flush_renames
        self.names: Names | None = None  # built on the first `fresh` call
        self.constants: dict[int, str] = {}  # id(lifted tensor) → its CONSTANT Var (forward and backward share one)

    def fresh(self, base: str) -> str:
        """A name not yet used in the Program. The names are collected once, on the first call: the FX node names
        added after it are plain identifiers, which never equal a fresh name (its base has a `.` or `@`)."""
        if self.names is None:
            self.names = Names(self.program)
        return self.names.fresh(base)

    def name_of(self, target: str) -> str:
        name = _strip_model_prefix(target) if self.wrapped else target
        return self.canonical.get(name, name)

    def placeholder(self, node: torch.fx.Node) -> None:
        desc = node.meta.get("desc")
        value = node.meta.get("val")
        if isinstance(desc, (ParamAOTInput, BufferAOTInput)) and self.name_of(desc.target) in self.block.vars:
            self.env[node] = Ref(self.name_of(desc.target))  # a tied alias: one Var (a direct trace lists each)
            return
        if isinstance(desc, ParamAOTInput):
            var = _var_from_value(self.name_of(desc.target), value, VarKind.PARAM, self.symbols)
        elif isinstance(desc, BufferAOTInput):
            var = _var_from_value(self.name_of(desc.target), value, VarKind.BUFFER, self.symbols)
        elif isinstance(desc, PlainAOTInput):
            var = _var_from_value(self.feed_names[desc.idx], value, VarKind.DATA, self.symbols)
            self.program.feeds.append(var.name)
        elif isinstance(desc, TangentAOTInput):
            self.env[node] = "tangent"  # becomes ones_like(loss), emitted with the output node
            return
        else:
            raise CaptureError(f"unexpected graph input {node.name} ({desc!r})")
        self.block.add_var(var)
        self.env[node] = Ref(var.name)

    def arg(self, value: Any) -> Any:
        return map_node_args(value, self._ref)

    def _ref(self, node: torch.fx.Node) -> Any:
        ref = self.env[node]
        return Ref(grad_name(LOSS_VAR)) if ref == "tangent" else ref

    def attrs(self, node: torch.fx.Node) -> dict:
        backward = node.meta.get("partitioner_tag") == "is_backward"
        raw = _raw_module_path(node, backward) or ""
        path = _strip_model_prefix(raw) if self.wrapped else raw
        role = OpRole.BACKWARD if backward else OpRole.FORWARD
        in_model = raw == MODEL_ATTR or raw.startswith(MODEL_ATTR + ".")
        if not backward and self.loss_ops and not in_model:
            role |= OpRole.LOSS
        attrs = {"op_role": int(role), "module_path": path}
        seq_nr = node.meta.get("seq_nr")
        if backward and seq_nr in self.seq_to_forward:
            candidates = self.seq_to_forward[seq_nr]
            same_module = [op for op in candidates if op.module_path == path]
            attrs["forward_op"] = (same_module or candidates)[-1].name
        custom = node.meta.get("custom") or {}
        if custom.get("op_device"):
            attrs["op_device"] = custom["op_device"]
        if custom.get(FP16_GUARD):
            attrs[FP16_GUARD] = True
        source = user_frame_from_stack_trace(node.meta.get("stack_trace"))
        if source:
            attrs["source"] = source
        return attrs

    def node_name(self, node: torch.fx.Node) -> str:
        """The Program name of the op or value a node makes."""
        return node.name

    def call(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:
            parent, index = node.args
            outputs = self.env[parent]
            var = _var_from_value(self.node_name(node), node.meta["val"], VarKind.TEMP, self.symbols)
            self.block.add_var(var)
            outputs[index] = var.name
            self.env[node] = Ref(var.name)
            return
        if node.target in SCALAR_OPS and self.symbols is not None:
            op_type = f"fleetc.{SCALAR_OPS[node.target]}"  # size arithmetic of a symbolic trace (`b * t`)
        elif isinstance(node.target, torch._ops.OpOverload):
            op_type = str(node.target)
        else:
            raise _not_an_operator(node)
        value = node.meta.get("val")
        if value is None and not node.users:
            self.drop_check(node)
            return
        name = self.node_name(node)
        op = Op(name, op_type, tuple(self.arg(a) for a in node.args),
                {k: self.arg(v) for k, v in node.kwargs.items()}, attrs=self.attrs(node))
        if isinstance(value, (tuple, list)):
            op.outputs = [None] * len(value)
            self.env[node] = op.outputs  # getitem nodes fill the slots they read
        else:
            var = self.block.add_var(_var_from_value(name, value, VarKind.TEMP, self.symbols))
            op.outputs = [var.name]
            self.env[node] = Ref(var.name)
        if OpRole.FORWARD in op.role and node.meta.get("seq_nr") is not None:
            self.seq_to_forward.setdefault(node.meta["seq_nr"], []).append(op)
        self.block.ops.append(op)

    def constant(self, node: torch.fx.Node) -> None:
        """A lifted tensor constant (`torch.tensor(...)` or a table made in forward): a CONSTANT Var."""
        value = getattr(self.gm, node.target)
        if not isinstance(value, torch.Tensor):  # a subgraph of a higher-order op (torch.cond, ...)
            raise _not_an_operator(next(iter(node.users), node))
        if id(value) in self.constants:
            self.env[node] = Ref(self.constants[id(value)])
            return
        name = self.fresh(f"const.{node.name.lstrip('_')}")
        try:
            add_constant(self.program, name, value)
        except TypeError as exc:
            users = [u for u in node.users if u.meta.get("stack_trace")]
            source = user_frame_from_stack_trace(users[0].meta["stack_trace"]) if users else ""
            raise CaptureError(f"cannot capture a tensor constant made in forward at "
                               f"{source or 'an unknown location'}: {exc}\n"
                               "  hint: make it a registered buffer (module.register_buffer) instead") from None
        self.constants[id(value)] = name
        self.env[node] = Ref(name)

    def drop_check(self, node: torch.fx.Node) -> None:
        """Drop a result-less check op (CHECK_OPS); refuse any other op without a result."""
        target = str(node.target)
        if target not in CHECK_OPS:
            source = user_frame_from_stack_trace(node.meta.get("stack_trace")) or "an unknown location"
            raise CaptureError(f"cannot capture the op {target} at {source}: it returns nothing, so it only has a "
                               f"side effect, which a Program cannot keep\n  hint: remove the call from the "
                               f"training step, or run it outside forward")
        dropped = self.program.metadata.setdefault("dropped_checks", {})
        dropped[target] = dropped.get(target, 0) + 1

    def flush_renames(self) -> None:
        """Apply the renames `bind_result` queued."""
        mapping, self.renames = self.renames, {}
        rename_temporaries(self.program, mapping)

    def bind_result(self, ref: Ref, wanted: str, module_path: str, role: OpRole) -> str:
        """Give the value `ref` the name `wanted`: rename its temporary (queued until `flush_renames`), or copy it
        when it is not a temporary or already has a name."""
        var = self.block.vars.get(ref.name)
        if (var is not None and var.kind is VarKind.TEMP and ref.name not in self.renames
                and ref.name not in self.program.fetches.values()):
            self.renames[ref.name] = wanted
            return wanted
        source = self.program.var(ref.name)
        self.block.add_var(Var(wanted, source.shape, source.dtype, source.device, VarKind.TEMP))
        self.block.ops.append(Op(self.fresh(f"{wanted}.clone"), "aten.clone.default", (ref,),
                                 outputs=[wanted], attrs={"op_role": int(role), "module_path": module_path}))
        return wanted

    def output(self, node: torch.fx.Node) -> None:
        descs = node.meta.get("desc") or []
        values = node.args[0]
        mutations: list[tuple[str, Ref]] = []
        grads: list[tuple[str, Ref]] = []
        input_grads: list[tuple[str, Ref]] = []  # of step inputs the caller passed with requires_grad=True
        for desc, value in zip(descs, values):
            if isinstance(desc, PlainAOTOutput):
                key = LOSS_VAR if self._has_tangent() else f"{OUTPUT_VAR}.{desc.idx}"
                self.program.fetches[key] = self.bind_result(self.arg(value), key, "", OpRole.FORWARD)
            elif isinstance(desc, InputMutationAOTOutput) and isinstance(desc.mutated_input, PlainAOTInput):
                self._input_write(desc.mutated_input, value)
            elif isinstance(desc, InputMutationAOTOutput):
                mutations.append((self.name_of(desc.mutated_input.target), self.arg(value)))
            elif isinstance(desc, GradAOTOutput) and value is not None and isinstance(desc.grad_of, PlainAOTInput):
                input_grads.append((self.feed_names[desc.grad_of.idx], self.arg(value)))
            elif isinstance(desc, GradAOTOutput) and value is not None:
                grads.append((self.name_of(desc.grad_of.target), self.arg(value)))
        self.flush_renames()
        if self._has_tangent():
            self._insert_loss_grad()
        self._insert_assigns(mutations)
        for param, ref in self._sum_tied(grads):
            name = self.bind_result(ref, grad_name(param), "", OpRole.BACKWARD)
            self.program.fetches[f"grad:{param}"] = name
        for feed, ref in input_grads:
            name = self.bind_result(ref, grad_name(feed), "", OpRole.BACKWARD)
            self.program.fetches[f"{INPUT_GRAD_FETCH}{feed}"] = name
        self.flush_renames()

    def _sum_tied(self, grads: list[tuple[str, Ref]]) -> list[tuple[str, Ref]]:
        """One gradient per parameter: a direct trace gives a tied parameter one gradient per alias, which add up."""
        summed: dict[str, Ref] = {}
        for param, ref in grads:
            if param in summed:
                total = self.fresh(f"{grad_name(param)}.tied_sum")
                first = self.program.var(summed[param].name)
                self.block.add_var(Var(total, first.shape, first.dtype, first.device, VarKind.TEMP))
                self.block.ops.append(Op(total, "aten.add.Tensor", (summed[param], ref), outputs=[total],
                                         attrs={"op_role": int(OpRole.BACKWARD), "module_path": ""}))
                ref = Ref(total)
            summed[param] = ref
        return list(summed.items())

    def _input_write(self, written: PlainAOTInput, value: Any) -> None:
        """A step argument written in place: the compiled step cannot hand the write back to the caller's tensor."""
        trace = value.meta.get("stack_trace") if isinstance(value, torch.fx.Node) else None
        where = f" at {source}" if (source := user_frame_from_stack_trace(trace)) else ""
        raise CaptureError(f"the step writes its input {self.feed_names[written.idx]!r} in place{where}; fleetc "
                           "does not write back into the caller's tensors: use an out-of-place op (x = x * 2 "
                           "instead of x.mul_(2)) or clone the input first")

    def _has_tangent(self) -> bool:
        return "tangent" in self.env.values()

    def _insert_loss_grad(self) -> None:
        """The backward seed: d(loss)/d(loss) = 1, placed just before the first backward op."""
        loss = self.program.var(LOSS_VAR)
        self.block.add_var(Var(grad_name(LOSS_VAR), loss.shape, loss.dtype, loss.device))
        seed = Op("loss_grad", "aten.ones_like.default", (Ref(LOSS_VAR),), outputs=[grad_name(LOSS_VAR)],
                  attrs={"op_role": int(OpRole.BACKWARD | OpRole.LOSS), "module_path": ""})
        first_backward = next((i for i, op in enumerate(self.block.ops) if OpRole.BACKWARD in op.role),
                              len(self.block.ops))
        self.block.ops.insert(first_backward, seed)

    def _insert_assigns(self, mutations: list[tuple[str, Ref]]) -> None:
        """Write each mutated buffer's new value once nothing reads its old value any more (one pass for all)."""
        if not mutations:
            return
        last_reader: dict[str, int] = {}
        definers: dict[str, list[int]] = {}
        for i, op in enumerate(self.block.ops):
            for name in op.inputs:
                last_reader[name] = i
            for name in op.defined:
                definers.setdefault(name, []).append(i)
        inserts = []
        for order, (buffer, ref) in enumerate(mutations):
            defined_at = definers.get(ref.name, [])
            after = max([last_reader.get(buffer, -1), *defined_at])
            producer = self.block.ops[defined_at[0]] if defined_at else None
            attrs = {"op_role": int(OpRole.FORWARD),
                     "module_path": producer.module_path if producer else buffer.rpartition(".")[0]}
            assign = Op(self.fresh(f"{buffer}.assign"), "fleetc.assign", (Ref(buffer), ref),
                        outputs=[buffer], attrs=attrs)
            inserts.append((after + 1, -order, assign))
        ops = self.block.ops
        merged = []
        position = 0
        for at, _, assign in sorted(inserts, key=lambda item: item[:2]):
            merged += ops[position:at]
            merged.append(assign)
            position = at
        self.block.ops = merged + ops[position:]

    def run(self) -> Program:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                self.output(node)
            elif node.op == "get_attr":
                self.constant(node)
            else:
                raise CaptureError(f"unexpected FX node kind {node.op!r} ({node.name})")
        return self.program


def graph_to_program(gm: torch.fx.GraphModule, feed_names: list[str], *, wrapped: bool, loss_fn_given: bool,
                     canonical: dict[str, str], symbols: SymbolTable | None = None) -> Program:
    """The Program of a traced step; `wrapped` when the graph came from a TrainStep module.

    `canonical` maps alias names of shared parameters/buffers to the one name the Program uses; `symbols` (a
    symbolic trace) turns SymInt sizes into sympy expressions in the Program's dim names.
    """
    return _Converter(gm, feed_names, wrapped, loss_fn_given, canonical, symbols).run()


class _Splicer(_Converter):
    """Appends the ops of a functional aten graph (from make_fx) to an existing Program's global block."""

    def __init__(self, program: Program, gm: torch.fx.GraphModule, inputs: list[Ref], prefix: str, attrs: dict,
                 names: Names):
        super().__init__(gm, [], wrapped=False, loss_ops=False, canonical={})
        self.program, self.block = program, program.global_block
        self.inputs, self.prefix, self.fixed_attrs = list(inputs), prefix, attrs
        self.names = names
        self.results: list[Ref] = []

    def node_name(self, node: torch.fx.Node) -> str:
        return self.names.fresh(f"{self.prefix}.{node.name}")

    def attrs(self, node: torch.fx.Node) -> dict:
        return dict(self.fixed_attrs)

    def placeholder(self, node: torch.fx.Node) -> None:
        self.env[node] = self.inputs.pop(0)

    def output(self, node: torch.fx.Node) -> None:
        outputs = node.args[0]
        self.results = [self.arg(v) for v in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]


def splice_graph(program: Program, gm: torch.fx.GraphModule, inputs: list[Ref], *, prefix: str,
                 attrs: dict, names: Names | None = None) -> list[Ref]:
    """Append `gm`'s ops (a functional aten graph whose placeholders read `inputs`, in order) to `program`, each
    named `<prefix>.<node>` and stamped with `attrs`; returns the Refs of its outputs.

    A node that is not an aten call (a tensor constant the function closed over) raises CaptureError. `names`
    (the Program's names, shared by several splices) saves rescanning the Program for fresh names.
    """
    splicer = _Splicer(program, gm, inputs, prefix, attrs, names or Names(program))
    splicer.run()
    return splicer.results
