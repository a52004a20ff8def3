"""Lowers fleetc's own ops to aten: each becomes the aten ops its reference decomposition runs, traced on fake tensors.

A Program without fleetc ops runs on plain PyTorch, and torch.export turns it into a graph any PyTorch process
loads. Only ops that write temporaries are lowered: an eval Program updates no state, and an op writing a
persistable has no functional form to export.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fleetc.capture.fx_args import map_node_args
from fleetc.errors import PassError
from fleetc.ir.program import (
    CONDITIONAL_BLOCK,
    Block,
    Op,
    Program,
    Ref,
    Var,
    VarKind,
    iter_refs,
    map_refs,
)
from fleetc.ir.registry import op_def
from fleetc.ir.usedef import Names
from fleetc.passes.base import PassReport

PROVENANCE = "lower_to_aten"


def _trace_reference(program: Program, block: Block, op: Op) -> tuple[torch.fx.GraphModule, list[str]]:
    """The reference of `op` traced on fake tensors shaped like its inputs; and the input Var per placeholder."""
    reference = op_def(op.type).reference
    inputs = list(iter_refs((op.args, op.kwargs)))
    mode = FakeTensorMode()
    fakes = []
    for name in inputs:
        var = program.var(name, block.idx)
        if var.shape is None:
            raise PassError(f"cannot lower {op.name!r} ({op.type}) to aten: its input {name!r} is a "
                            f"{var.dtype} scalar, not a tensor")
        with mode:
            fakes.append(torch.empty(var.shape, dtype=var.torch_dtype, device=var.device))

    def run(*tensors: torch.Tensor) -> Any:
        by_name = dict(zip(inputs, tensors))
        bind = lambda ref: by_name[ref.name]  # noqa: E731
        return reference(*map_refs(op.args, bind), **map_refs(op.kwargs, bind))

    return make_fx(run, tracing_mode="fake")(*fakes), inputs


def _results(gm: torch.fx.GraphModule, count: int) -> list[Any]:
    """The traced function's results as a list of `count` entries (nodes, or None)."""
    value = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    if len(values) != count:
        raise PassError(f"reference returned {len(values)} results for {count} outputs")
    return values


def lower_op(program: Program, block: Block, op: Op, names: Names) -> list[Op]:
    """The aten ops computing `op`'s outputs; new temporaries are added to `block`."""
    if op.type == CONDITIONAL_BLOCK:
        raise PassError(f"cannot lower {op.name!r} to aten: control flow (a conditional block) cannot be exported")
    for name in op.defined:
        if program.var(name, block.idx).kind is not VarKind.TEMP:
            raise PassError(f"cannot lower {op.name!r} ({op.type}) to aten: it writes the persistable {name!r} "
                            "(only ops without side effects can be exported)")
    gm, inputs = _trace_reference(program, block, op)
    results = _results(gm, len(op.outputs))
    bound: dict[torch.fx.Node, str] = {}  # the traced value each output Var takes its name from
    for node, name in zip(results, op.outputs):
        if name is not None and isinstance(node, torch.fx.Node) and node.op == "call_function" and node not in bound:
            bound[node] = name
    attrs = {k: v for k, v in op.attrs.items() if k != "fused_from"}
    attrs["provenance"] = PROVENANCE
    env: dict[torch.fx.Node, Any] = {}  # node → Ref, or a list of Var names for a multi-result op
    lowered: list[Op] = []

    def arg(value: Any) -> Any:
        return map_node_args(value, env.__getitem__)

    def var_for(node: torch.fx.Node) -> str:
        if node in bound:
            return bound[node]
        val = node.meta["val"]
        var = Var(names.fresh(f"{op.name}.{node.name}"), tuple(int(d) for d in val.shape),
                  str(val.dtype).removeprefix("torch."), str(val.device))
        block.add_var(var)
        return var.name

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env.update({node: Ref(name) for node, name in zip(placeholders, inputs)})
    for node in gm.graph.nodes:
        if node.op != "call_function":
            if node.op not in ("placeholder", "output"):
                raise PassError(f"cannot lower {op.name!r} ({op.type}) to aten: its reference makes a "
                                f"{node.op} node ({node.name})")
            continue
        if node.target is operator.getitem:
            parent, index = node.args
            env[parent][index] = var_for(node)
            env[node] = Ref(env[parent][index])
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
            raise PassError(f"cannot lower {op.name!r} ({op.type}) to aten: its reference calls {node.target}")
        new = Op(names.fresh(f"{op.name}.{node.name}"), str(node.target), tuple(arg(a) for a in node.args),
                 {k: arg(v) for k, v in node.kwargs.items()}, attrs=dict(attrs))
        if isinstance(node.meta.get("val"), (tuple, list)):
            new.outputs = [None] * len(node.meta["val"])
            env[node] = new.outputs  # getitem nodes fill the slots they read
        else:
            new.outputs = [var_for(node)]
            env[node] = Ref(new.outputs[0])
        lowered.append(new)
    for node, name in zip(results, op.outputs):
        if name is not None and bound.get(node) != name:  # an input passed through, or one value twice
            lowered.append(Op(names.fresh(f"{name}.clone"), "aten.clone.default", (arg(node),), outputs=[name],
                              attrs=dict(attrs)))
    return lowered


class LowerToAten:
    name = "lower_to_aten"
    summary = "replace each fleetc op by the aten ops of its reference decomposition"
    reads: tuple[str, ...] = ()

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        names = Names(program)
        for block in program.blocks:
            ops: list[Op] = []
            for op in block.ops:
                if not op.type.startswith("fleetc."):
                    ops.append(op)
                    continue
                lowered = lower_op(program, block, op, names)
                ops += lowered
                report.count("ops_lowered")
                report.count("aten_ops_emitted", len(lowered))
            block.ops = ops
        report.changed = "ops_lowered" in report.stats
        if not report.changed:
            report.skipped_reason = "the Program has no fleetc ops"
        return program, report
