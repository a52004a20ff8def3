"""Gemm epilogue fusion (`fuse_gemm_epilogue`, `fused_passes.gemm_epilogue`): addmm [+ reshape to the
leading batch dims] [+ activation], or mm [+ reshape] + an explicit 1-D bias add [+ activation] → one op;
its backward (activation grad, dX, dW, dBias) → one op."""
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

_ADDMM = "aten.addmm.default"
_MM = "aten.mm.default"
_ADD = "aten.add.Tensor"
_VIEW = "aten.view.default"
_VIEWS = (_VIEW, "aten._unsafe_view.default")  # matmul of a batched input reshapes back with _unsafe_view


def _plain(op: Op | None, op_type: str, arity: int) -> bool:
    return (op is not None and op.type == op_type and not op.kwargs and len(op.args) == arity
            and all(isinstance(a, Ref) for a in op.args))


def _follow_view(index: BlockIndex, group: list[Op], out: str) -> tuple[str, list | None]:
    """Take a reshape of `out` into the group when it is the value's one forward reader."""
    reader = index.next_in_chain(out)
    if reader is not None and reader.type in _VIEWS and reader.args[0] == Ref(out):
        group.append(reader)
        return reader.outputs[0], list(reader.args[1])
    return out, None


def _bias_add(index: BlockIndex, mm: Op, out: str) -> tuple[Op, Ref] | None:
    """`add.Tensor(out, bias)` (either order) with `bias` a 1-D tensor of mm's column count and dtype."""
    add = index.next_in_chain(out)
    if not _plain(add, _ADD, 2) or add.args.count(Ref(out)) != 1:
        return None
    bias = next(a for a in add.args if a != Ref(out))
    mm_var, bias_var = index.var(mm.outputs[0]), index.var(bias.name)
    columns = list(mm_var.shape or ())[-1:]
    if list(bias_var.shape or ()) != columns or bias_var.dtype != mm_var.dtype:
        return None  # anything else is not the per-column bias addmm adds (or would change the result dtype)
    if list(index.var(out).shape or ())[-1:] != columns:
        return None  # a reshape that moved the columns: the bias no longer lines up with them
    return add, bias


def _gemm_with_bias(index: BlockIndex, op: Op) -> tuple[list[Op], str, list | None, tuple] | None:
    """(group, its output, reshape target, (bias, x, w_t)) for `addmm [+ view]` or `mm [+ view] + bias`."""
    if _plain(op, _ADDMM, 3):
        if len(index.var(op.args[0].name).shape or ()) != 1:
            return None  # only a per-column bias is an epilogue
        group = [op]
        out, out_shape = _follow_view(index, group, op.outputs[0])
        return group, out, out_shape, op.args
    if _plain(op, _MM, 2):  # `x @ w.t() + b` written out: the bias add follows the (reshaped) product
        group = [op]
        out, out_shape = _follow_view(index, group, op.outputs[0])
        found = _bias_add(index, op, out)
        if found is None:
            return None
        add, bias = found
        group.append(add)
        return group, add.outputs[0], out_shape, (bias, *op.args)
    return None


def _match_forward(index: BlockIndex, op: Op) -> Fusion | None:
    found = _gemm_with_bias(index, op)
    if found is None:
        return None
    group, out, out_shape, (bias, x, w_t) = found
    reader = index.next_in_chain(out)
    act, param = None, None
    found = match_activation(reader.type, reader.args, reader.kwargs) if reader is not None else None
    if found is not None and reader.args[0] == Ref(out):
        (act, param), pre = found, out
        group.append(reader)
        out = reader.outputs[0]
    # the act is pre's one forward reader (next_in_chain): any later reader is a backward op, i.e. the act grad
    pre_act = kept(index, group, pre) if act else None
    return Fusion(group, Op("fused_gemm_epilogue", "fleetc.fused_gemm_epilogue",
                            (x, w_t, bias, out_shape, act.name if act else None, param, pre_act is not None),
                            outputs=[out, pre_act]))


def _match_backward(index: BlockIndex, fwd: Op, backward: list[Op]) -> Fusion | str:
    """Classify every backward op of the group: act grad, 2-D view, t, mm (dX or dW), sum + view (dBias)."""
    x, w_t, _, out_shape, act_name, param, _ = fwd.args
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
    # dBias sums the 2-D grad over rows (addmm), or the grad before its 2-D view over the leading dims (mm + add)
    leading = list(range(len(out_shape) - 1)) if out_shape else None
    col_sum = take(lambda op: op.type == "aten.sum.dim_IntList" and (
        (op.args[1:] == ([0], True) and (g is None or op.args[0] == g))
        or (to_2d is not None and op.args[1:] == (leading, True) and op.args[0] == to_2d.args[0])))
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
    enabled_by = 'build_strategy.fuse_gemm_epilogue'
    summary = ("addmm [+ view] or mm [+ view] + bias, [+ activation] → fleetc.fused_gemm_epilogue; "
               "dX, dW, dBias → fleetc.fused_gemm_epilogue_grad")
    reads = ("build_strategy.fuse_gemm_epilogue",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fuse_forward_and_backward(program, report, self.name, _match_forward, _match_backward)
        no_match_reason(report, "matmul with a bias (addmm, or mm + a 1-D bias add)")
        return program, report
