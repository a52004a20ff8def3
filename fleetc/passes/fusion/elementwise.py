"""Elementwise add + activation fusion (`fuse_elewise_add_act_ops`): act(add(x, y)) and add(x, act(y)) → one
op; the activation's gradient op → the fused gradient op (the add's own gradient is the identity)."""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Op, Program, Ref
from fleetc.ops.activations import (
    ACTIVATIONS,
    grad_saved_arg,
    is_grad_op,
    match_activation,
)
from fleetc.passes.base import PassReport
from fleetc.passes.fusion.match import (
    BlockIndex,
    Fusion,
    fuse_forward_and_backward,
    kept,
    no_match_reason,
)

_ADD = "aten.add.Tensor"


def _is_plain_add(op: Op | None) -> bool:
    return (op is not None and op.type == _ADD and not op.kwargs and len(op.args) == 2
            and all(isinstance(a, Ref) for a in op.args))


def _activation(op: Op | None) -> tuple[Any, Any] | None:
    if op is None or not op.args or not isinstance(op.args[0], Ref):
        return None
    return match_activation(op.type, op.args, op.kwargs)


def _match_forward(index: BlockIndex, op: Op) -> Fusion | None:
    if _is_plain_add(op):  # act(x + y)
        act_op = index.next_in_chain(op.outputs[0])
        found = _activation(act_op)
        if found is None or act_op.args[0] != Ref(op.outputs[0]):
            return None
        (act, param), group, (x, y), act_first = found, [op, act_op], op.args, False
    else:  # x + act(y)
        found = _activation(op)
        add = index.next_in_chain(op.outputs[0]) if found else None
        if not _is_plain_add(add) or add.args.count(Ref(op.outputs[0])) != 1:
            return None
        (act, param), group, act_first = found, [op, add], True
        y = op.args[0]
        x = next(a for a in add.args if a != Ref(op.outputs[0]))  # add is commutative, bit for bit
    inter = group[0].outputs[0]
    fused = Op("fused_elemwise_add_act", "fleetc.fused_elemwise_add_act", (x, y, act_first, act.name, param),
               outputs=[group[1].outputs[0], kept(index, group, inter)])
    return Fusion(group, fused)


def _match_backward(index: BlockIndex, fwd: Op, backward: list[Op]) -> Fusion | str:
    act_name, param = fwd.args[3], fwd.args[4]
    act = ACTIVATIONS[act_name]
    grads = [op for op in backward if is_grad_op(act, param, op.type, op.args, op.kwargs)]
    if len(grads) != 1:
        return f"expected one {act.grad_type} among {[op.type for op in backward]}"
    grad = grads[0]
    fused = Op("fused_elemwise_add_act_grad", "fleetc.fused_elemwise_add_act_grad",
               (grad.args[0], grad_saved_arg(act, grad.args), act_name, param), outputs=list(grad.outputs))
    return Fusion([grad], fused)


class FuseElementwiseAddAct:
    name = "fuse_elewise_add_act"
    enabled_by = 'build_strategy.fuse_elewise_add_act_ops'
    summary = "act(x + y) and x + act(y) → fleetc.fused_elemwise_add_act; the act's grad → its fused grad op"
    reads = ("build_strategy.fuse_elewise_add_act_ops",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fuse_forward_and_backward(program, report, self.name, _match_forward, _match_backward)
        no_match_reason(report, "elementwise add next to an activation")
        return program, report
