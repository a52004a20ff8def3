"""Gemm epilogue fusion (`fuse_gemm_epilogue`, `fused_passes.gemm_epilogue`): addmm [+ reshape to the
leading batch dims] [+ activation] → one op; its backward (activation grad, dX, dW, dBias) → one op."""
from __future__ import annotations

from typing import Any

from fleetc.ir.program import Op, Program, Ref
from fleetc.ops.activations import ACTIVATIONS, grad_saved_arg, is_grad_op, match_activation
from fleetc.passes.base import PassReport
from fleetc.passes.fusion_match import BlockIndex, Fusion, fuse_forward_and_backward, kept, no_match_reason

_ADDMM = "aten.addmm.default"
_VIEW = "aten.view.default"


def _match_forward(index: BlockIndex, op: Op) -> Fusion | None:
    if op.type != _ADDMM or op.kwargs or len(op.args) != 3 or not all(isinstance(a, Ref) for a in op.args):
        return None
    if len(index.var(op.args[0].name).shape or ()) != 1:
        return None  # only a per-column bias is an epilogue
    group, out, out_shape = [op], op.outputs[0], None
    reader = index.next_in_chain(out)
    if reader is not None and reader.type == _VIEW and reader.args[0] == Ref(out):
        group.append(reader)
        out, out_shape = reader.outputs[0], list(reader.args[1])
        reader = index.next_in_chain(out)
    act, param = None, None
    found = match_activation(reader.type, reader.args, reader.kwargs) if reader is not None else None
    if found is not None and reader.args[0] == Ref(out):
        (act, param), pre = found, out
        group.append(reader)
        out = reader.outputs[0]
    bias, x, w_t = op.args
    outputs = [out, kept(index, group, pre) if act else None]
    return Fusion(group, Op("fused_gemm_epilogue", "fleetc.fused_gemm_epilogue",
                            (x, w_t, bias, out_shape, act.name if act else None, param), outputs=outputs))


def _match_backward(index: BlockIndex, fwd: Op, backward: list[Op]) -> Fusion | str:
    """Classify every backward op of the group: act grad, 2-D view, t, mm (dX or dW), sum + view (dBias)."""
    x, w_t, _, _, act_name, param = fwd.args
    act = ACTIVATIONS[act_name] if act_name else None
    remaining = list(backward)

    def take(predicate) -> Op | None:
        found = [op for op in remaining if predicate(op)]
        if len(found) != 1:
            return None
        remaining.remove(found[0])
        return found[0]

    act_grad = take(lambda op: is_grad_op(act, param, op.type, op.args, op.kwargs)) if act else None
    if act and act_grad is None:
        return f"no single {act.grad_type} among the backward ops"
    g = Ref(act_grad.outputs[0]) if act_grad else None
    to_2d = take(lambda op: op.type == _VIEW and len(op.args[1]) == 2 and (g is None or op.args[0] == g))
    dout = act_grad.args[0] if act_grad else to_2d.args[0] if to_2d else None
    g = Ref(to_2d.outputs[0]) if to_2d else g
    t_w = take(lambda op: op.type == "aten.t.default" and op.args[0] == w_t)
    col_sum = take(lambda op: op.type == "aten.sum.dim_IntList" and op.args[1:] == ([0], True)
                   and (g is None or op.args[0] == g))
    g = g or (col_sum.args[0] if col_sum else None)
    t_g = take(lambda op: op.type == "aten.t.default" and (g is None or op.args[0] == g))
    g = g or (t_g.args[0] if t_g else None)
    dout = dout or g
    dw = take(lambda op: op.type == "aten.mm.default" and t_g is not None and op.args == (Ref(t_g.outputs[0]), x))
    dx = take(lambda op: op.type == "aten.mm.default" and t_w is not None and op.args == (g, Ref(t_w.outputs[0])))
    db = take(lambda op: op.type == _VIEW and col_sum is not None and op.args[0] == Ref(col_sum.outputs[0]))
    if remaining or dout is None:
        return f"unrecognised backward ops {[op.type for op in remaining]}"
    group = [op for op in backward if op not in remaining]
    outputs = [dx.outputs[0] if dx else None, dw.outputs[0] if dw else None, db.outputs[0] if db else None]
    saved = grad_saved_arg(act, act_grad.args) if act else None
    fused = Op("fused_gemm_epilogue_grad", "fleetc.fused_gemm_epilogue_grad",
               (dout, saved, x, w_t, act_name, param, [dx is not None, dw is not None, db is not None]),
               outputs=outputs)
    return Fusion(group, fused)


class FuseGemmEpilogue:
    name = "fuse_gemm_epilogue"
    summary = "addmm [+ view] [+ activation] → fleetc.fused_gemm_epilogue; dX, dW, dBias → fleetc.fused_gemm_epilogue_grad"
    reads = ("build_strategy.fuse_gemm_epilogue",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fuse_forward_and_backward(program, report, self.name, _match_forward, _match_backward)
        no_match_reason(report, "matmul with a bias (addmm)")
        return program, report
