"""Dropout + residual add fusion (`fuse_dropout_add`, `fused_passes.dropout_add`): native_dropout then
add → fleetc.fused_dropout_add; native_dropout_backward → fleetc.fused_dropout_add_grad."""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Op, Program, Ref
from fleetc.passes.base import PassReport
from fleetc.passes.fusion_match import BlockIndex, Fusion, fuse_forward_and_backward, no_match_reason

_DROPOUT = "aten.native_dropout.default"


def _match_forward(index: BlockIndex, op: Op) -> Fusion | None:
    if op.type != _DROPOUT or op.kwargs or op.outputs[0] is None:
        return None
    dropped = Ref(op.outputs[0])
    add = index.next_in_chain(dropped.name)
    if add is None or add.type != "aten.add.Tensor" or add.kwargs or add.args.count(dropped) != 1:
        return None
    residual = next(a for a in add.args if a != dropped)
    if not isinstance(residual, Ref) or index.var(residual.name).shape != index.var(dropped.name).shape:
        return None
    x, p, train = op.args
    fused = Op("fused_dropout_add", "fleetc.fused_dropout_add", (x, residual, p, train),
               outputs=[add.outputs[0], op.outputs[1]])
    return Fusion([op, add], fused)


def _match_backward(index: BlockIndex, fwd: Op, backward: list[Op]) -> Fusion | str:
    if len(backward) != 1 or backward[0].type != "aten.native_dropout_backward.default":
        return f"expected one native_dropout_backward, found {[op.type for op in backward]}"
    grad = backward[0]
    return Fusion([grad], Op("fused_dropout_add_grad", "fleetc.fused_dropout_add_grad", grad.args,
                             outputs=list(grad.outputs)))


class FuseDropoutAdd:
    name = "fuse_dropout_add"
    summary = "dropout + residual add → fleetc.fused_dropout_add (keeps the bool mask); backward → its grad op"
    reads = ("build_strategy.fuse_dropout_add",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fuse_forward_and_backward(program, report, self.name, _match_forward, _match_backward)
        no_match_reason(report, "training-mode dropout followed by a residual add")
        return program, report
