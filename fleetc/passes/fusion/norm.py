"""Batch norm fusion passes: bn + activation (`fuse_bn_act_ops`) and bn + residual add + activation
(`fuse_bn_add_act_ops`), forward (train and eval) and backward."""
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

_BN_TRAIN = "aten._native_batch_norm_legit_functional.default"
_BN_EVAL = "aten._native_batch_norm_legit_no_training.default"
_BN_BACKWARD = "aten.native_batch_norm_backward.default"
_ADD = "aten.add.Tensor"


def _running_stat_writes(index: BlockIndex, bn: Op) -> list[Op] | None:
    """The ops copying a training bn's new running stats into its buffers: `fleetc.assign(buffer, new)`, after a
    `_to_copy` to the buffer's dtype when it is not the statistics' dtype (bf16 buffers). None if not exactly that."""
    writes = []
    for new, buffer in ((bn.outputs[3], bn.args[3]), (bn.outputs[4], bn.args[4])):
        value, chain = new, []
        casts = [r for r in index.readers_of(new) if r.type == "aten._to_copy.default" and r.args[0] == Ref(new)]
        if len(casts) == 1:
            chain.append(casts[0])
            value = casts[0].outputs[0]
        assigns = [r for r in index.readers_of(value) if r.type == "fleetc.assign" and r.args[0] == buffer]
        if len(assigns) != 1:
            return None
        writes += [*chain, assigns[0]]
    return writes


def _activation_of(index: BlockIndex, name: str) -> tuple[Op, Any, Any] | None:
    """(act op, activation, constant) when the forward reader of `name` is an activation of it."""
    reader = index.next_in_chain(name)
    if reader is None or not reader.args or reader.args[0] != Ref(name):
        return None
    found = match_activation(reader.type, reader.args, reader.kwargs)
    return (reader, *found) if found else None


def _residual_add(index: BlockIndex, name: str) -> tuple[Op, Ref] | None:
    """(add op, the other addend) when the forward reader of `name` is `add.Tensor(name, z)` or `(z, name)`."""
    add = index.next_in_chain(name)
    if add is None or add.type != _ADD or add.kwargs or len(add.args) != 2:
        return None
    a, b = add.args
    other = b if a == Ref(name) else a if b == Ref(name) else None
    if not isinstance(other, Ref) or other == Ref(name):
        return None
    if index.var(other.name).shape != index.var(name).shape:
        return None  # a broadcast residual is not a ResNet shortcut
    return add, other


def _match_bn(index: BlockIndex, op: Op, with_add: bool) -> Fusion | None:
    if op.type not in (_BN_TRAIN, _BN_EVAL) or op.outputs[0] is None:
        return None
    training = op.type == _BN_TRAIN
    x, weight, bias, rmean, rvar = op.args[:5]
    momentum, eps = (op.args[6], op.args[7]) if training else (op.args[5], op.args[6])
    if training and op.args[5] is not True:
        return None
    writes = _running_stat_writes(index, op) if training else []
    if writes is None:
        return None
    pre, residual, add = op.outputs[0], None, None
    if with_add:
        found = _residual_add(index, pre)
        if found is None:
            return None
        add, residual = found
        pre = add.outputs[0]
    found_act = _activation_of(index, pre)
    if found_act is None:
        return None
    act_op, act, param = found_act
    group = [op, *writes, *([add] if add else []), act_op]
    saves = [op.outputs[1], op.outputs[2]] if training else [None, None]
    outputs = [act_op.outputs[0], kept(index, group, pre), *(kept(index, group, n) for n in saves)]
    args = (x, *([residual] if with_add else []), weight, bias, rmean, rvar, training, momentum, eps, act.name, param)
    kind = "bn_add_act" if with_add else "bn_act"
    fused = Op(f"fused_{kind}", f"fleetc.fused_{kind}", args,
               outputs=outputs + ([rmean.name, rvar.name] if training else []))
    # After the fused op the buffers hold the new running stats (in their own dtype), so later readers use them;
    # the only such reader is the training-mode backward, which reads the saved batch statistics instead.
    rename = {op.outputs[3]: rmean.name, op.outputs[4]: rvar.name} if training else {}
    rename.update({w.args[1].name: w.args[0].name for w in writes if w.type == "fleetc.assign"})
    return Fusion(group, fused, rename)


def _match_backward(index: BlockIndex, fwd: Op, backward: list[Op]) -> Fusion | str:
    """The activation's gradient op followed by native_batch_norm_backward, both differentiating `fwd`."""
    act_name, param = fwd.args[-2], fwd.args[-1]
    act = ACTIVATIONS[act_name]
    grads = [op for op in backward if is_grad_op(act, param, op.type, op.args, op.kwargs)]
    norms = [op for op in backward if op.type == _BN_BACKWARD]
    if len(grads) != 1 or len(norms) != 1 or len(backward) != 2:
        return f"expected one {act.grad_type} and one {_BN_BACKWARD}, found {[op.type for op in backward]}"
    act_grad, bn_grad = grads[0], norms[0]
    if bn_grad.args[0] != Ref(act_grad.outputs[0]):
        return "the batch-norm backward does not read the activation's gradient"
    group = [act_grad, bn_grad]
    dx, dw, db = bn_grad.outputs
    outputs = [dx, dw, db, kept(index, group, act_grad.outputs[0])]
    args = (act_grad.args[0], grad_saved_arg(act, act_grad.args), *bn_grad.args[1:], act_name, param)
    return Fusion(group, Op("fused_bn_act_grad", "fleetc.fused_bn_act_grad", args, outputs=outputs))


class _FuseBatchNorm:
    with_add: bool
    flag: str
    pattern: str

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        fuse_forward_and_backward(program, report, self.name, lambda index, op: _match_bn(index, op, self.with_add),
                                  _match_backward)
        no_match_reason(report, self.pattern)
        return program, report


class FuseBnAct(_FuseBatchNorm):
    name = "fuse_bn_act"
    enabled_by = "build_strategy.fuse_bn_act_ops"
    summary = "batch norm (train or eval) + activation → fleetc.fused_bn_act; backward → fleetc.fused_bn_act_grad"
    reads = ("build_strategy.fuse_bn_act_ops",)
    with_add = False
    pattern = "batch norm followed by an activation"


class FuseBnAddAct(_FuseBatchNorm):
    name = "fuse_bn_add_act"
    enabled_by = "build_strategy.fuse_bn_add_act_ops"
    summary = "batch norm + residual add + activation → fleetc.fused_bn_add_act; backward → fleetc.fused_bn_act_grad"
    reads = ("build_strategy.fuse_bn_add_act_ops",)
    with_add = True
    pattern = "batch norm followed by a residual add and an activation"
