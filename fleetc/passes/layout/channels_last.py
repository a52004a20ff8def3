"""Channels-last layout for CPU convolutions (`build_strategy.conv_channels_last`, a fleetc extension).

On these CPUs (oneDNN) a convolution of an NCHW activation is ~3x slower than of a channels_last one, and aten's
mkldnn convolution and its backward copy every NCHW activation to channels_last first (bench/README.md). This pass
keeps the convolution chain channels_last, as torch.compile's layout optimization does:

- a 4-D CPU convolution input that is not channels_last already (the network input, a view's result) is copied
  to channels_last once (`aten.clone(x, memory_format=torch.channels_last)`); the convolution and its backward read
  the copy;
- results of convolutions, and of the ops between them that compute the same values in either layout and give
  their result their input's layout (`KEEPS_LAYOUT`: pointwise ops, batch norm, pooling, the fused ops and their
  backwards), are channels_last;
- ops in `ANY_LAYOUT` (dim permutations, reductions) read a channels_last value as it is, but their result is not
  channels_last;
- any other op reading a channels_last value (a view before the classifier, a matmul, dropout, whose mask must be
  drawn in eager's element order) reads an NCHW copy (`memory_format=torch.contiguous_format`), and so do a fetch
  and a conditional block's ops (the copy is made before the block, the ops inside are renamed);
- a convolution's weight gradient (aten returns it channels_last when the input is) is copied back under its own
  name, so optimizers, gradient buckets and `grad:` fetches see the contiguous gradient they see without the pass;
- fused batch-norm ops of channels_last values are marked `attrs["memory_format"] = "channels_last"`, so the CPU
  backend runs its NHWC kernels (fleetc/codegen/cpu/norm.py) instead of copying back to NCHW.

A value whose two layouts are the same memory order (one channel, or 1×1 spatial) is never copied. Values are
equal in either layout; only oneDNN's summation order inside a convolution differs (fp32 rounding). The report
counts the convolutions, the copies each way and the batch norms marked.
"""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.liveness import block_reads
from fleetc.ir.program import Op, Program, Ref, Var, VarKind
from fleetc.ir.usedef import Names
from fleetc.passes.base import PassReport

CONV = "aten.convolution.default"
CONV_BACKWARD = "aten.convolution_backward.default"
CLONE = "aten.clone.default"
CHANNELS_LAST = "channels_last"  # the value of op.attrs["memory_format"] (fleetc/codegen/cpu/norm.py reads it)

# Ops whose values do not depend on their inputs' layout and whose 4-D results take their 4-D inputs' layout.
KEEPS_LAYOUT = frozenset({
    CONV, CONV_BACKWARD,
    "aten._native_batch_norm_legit_functional.default", "aten._native_batch_norm_legit_no_training.default",
    "aten._native_batch_norm_legit.default", "aten.native_batch_norm_backward.default",
    "aten.max_pool2d_with_indices.default", "aten.max_pool2d_with_indices_backward.default",
    "aten.avg_pool2d.default", "aten.avg_pool2d_backward.default",
    "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d_backward.default",
    "aten.relu.default", "aten.threshold_backward.default", "aten.hardtanh.default", "aten.hardtanh_backward.default",
    "aten.silu.default", "aten.silu_backward.default", "aten.sigmoid.default", "aten.sigmoid_backward.default",
    "aten.gelu.default", "aten.gelu_backward.default", "aten.leaky_relu.default", "aten.leaky_relu_backward.default",
    "aten.tanh.default", "aten.tanh_backward.default",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default",
    "aten._to_copy.default", "aten.constant_pad_nd.default",
    "fleetc.fused_bn_act", "fleetc.fused_bn_add_act", "fleetc.fused_bn_act_grad",
    "fleetc.fused_elementwise", "fleetc.fused_elemwise_add_act", "fleetc.fused_elemwise_add_act_grad",
    "fleetc.assign",
})
# Ops that read a value in any layout but whose result does not take it (views that reorder dims, reductions).
ANY_LAYOUT = frozenset({"aten.permute.default", "aten.transpose.int", "aten.mean.dim", "aten.mean.default",
                        "aten.sum.dim_IntList", "aten.sum.default"})
# Fused batch norms with NHWC kernels, and the argument holding their activation.
_MARKED = {"fleetc.fused_bn_act": 0, "fleetc.fused_bn_add_act": 0, "fleetc.fused_bn_act_grad": 2}
_KEPT_ATTRS = ("op_role", "module_path", "forward_op", "op_device", "source")


class ChannelsLast:
    name = "channels_last"
    enabled_by = "build_strategy.conv_channels_last"
    summary = "CPU convolution activations (and the ops between convolutions) in channels_last memory format"
    reads = ("build_strategy.conv_channels_last",)

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        block = program.global_block
        if not any(op.type == CONV and _spatial(program, op.args[0]) for op in block.ops):
            report.skipped_reason = "no 2-D convolution of a CPU tensor"
        else:
            _Rewrite(program, report).run()
            report.changed = set(report.stats) != {"convolutions"}
            if not report.changed:
                report.skipped_reason = "every convolution's values are in the same memory order in both layouts"
        return program, report


def _nested_ops(program: Program, block_idx: int) -> list[Op]:
    """The ops of a sub-block and of the sub-blocks inside it."""
    ops = []
    for op in program.blocks[block_idx].ops:
        ops.append(op)
        if op.sub_block is not None:
            ops += _nested_ops(program, op.sub_block)
    return ops


def _spatial(program: Program, arg: Any) -> bool:
    """Whether `arg` is a 4-D CPU tensor (a 2-D convolution's activation)."""
    if not isinstance(arg, Ref):
        return False
    var = program.var(arg.name)
    return var.device == "cpu" and var.shape is not None and len(var.shape) == 4


def _layouts_differ(var: Var) -> bool:
    """Whether NCHW and channels_last order a 4-D value's elements differently (not for one channel or 1×1 maps)."""
    if var.shape is None or len(var.shape) != 4:
        return False
    _, c, h, w = var.shape
    return not (c == 1 or (h == 1 and w == 1))


class _Rewrite:
    """One walk over the global block: which values are channels_last, and the copies at the layout boundaries."""

    def __init__(self, program: Program, report: PassReport):
        self.program, self.report, self.block = program, report, program.global_block
        self.names = Names(program)
        self.nhwc: set[str] = set()
        self.copies: dict[tuple[str, bool], str] = {}
        self.ops: list[Op] = []

    def run(self) -> None:
        for op in self.block.ops:
            if op.type == CONV and _spatial(self.program, op.args[0]):
                self.report.count("convolutions")
                op.args = (self._as_nhwc(op.args[0], op), *op.args[1:])
                self.ops.append(op)
                self.nhwc.add(op.outputs[0])
            elif op.type == CONV_BACKWARD and _spatial(self.program, op.args[1]):
                op.args = (op.args[0], self._as_nhwc(op.args[1], op), *op.args[2:])
                self.ops.append(op)
                if op.outputs[0] is not None:
                    self.nhwc.add(op.outputs[0])
                self._contiguous_weight_grad(op)
            else:
                self._other(op)
        for key, name in list(self.program.fetches.items()):
            if name in self.nhwc and _layouts_differ(self.program.var(name)):
                self.program.fetches[key] = self._copy(name, False, self._producer(name))
        self.block.ops = self.ops

    def _other(self, op: Op) -> None:
        keeps = op.type in KEEPS_LAYOUT
        if not keeps and op.type not in ANY_LAYOUT:
            mapping = {r: self._copy(r, False, op) for r in block_reads(self.program, op)
                       if r in self.nhwc and _layouts_differ(self.program.var(r))}
            op.rename_inputs(mapping)
            if op.sub_block is not None and mapping:
                for inner in _nested_ops(self.program, op.sub_block):
                    inner.rename_inputs(mapping)
        self.ops.append(op)
        if not keeps or not any(r in self.nhwc for r in op.inputs):
            return
        self.nhwc.update(o for o in op.defined if _spatial(self.program, Ref(o)))
        x = op.args[_MARKED[op.type]] if op.type in _MARKED else None
        if isinstance(x, Ref) and x.name in self.nhwc and len(self.program.var(x.name).shape) == 4:
            op.attrs["memory_format"] = CHANNELS_LAST
            self.report.count("batch_norms_channels_last")

    def _as_nhwc(self, arg: Ref, op: Op) -> Ref:
        """The channels_last value of a convolution's input: itself, or its copy."""
        if arg.name in self.nhwc or not _layouts_differ(self.program.var(arg.name)):
            return arg
        return Ref(self._copy(arg.name, True, op))

    def _contiguous_weight_grad(self, op: Op) -> None:
        """The backward writes the weight gradient under a new name; an NCHW copy takes the gradient's own name."""
        grad = op.outputs[1]
        if grad is None or not _layouts_differ(self.program.var(grad)):
            return
        source = self.program.var(grad)
        raw = self.names.fresh(f"{grad}@NHWC")
        self.block.add_var(Var(raw, source.shape, source.dtype, source.device, VarKind.TEMP))
        op.outputs[1] = raw
        self.ops.append(self._clone(op, raw, grad, torch.contiguous_format))
        self.report.count("weight_grads_to_nchw")

    def _copy(self, name: str, nhwc: bool, template: Op) -> str:
        """The Var holding `name` in the other layout, inserting the copy before the op being rewritten once."""
        key = (name, nhwc)
        if key not in self.copies:
            source = self.program.var(name)
            out = self.names.fresh(f"{name}@{'NHWC' if nhwc else 'NCHW'}")
            self.block.add_var(Var(out, source.shape, source.dtype, source.device, VarKind.TEMP))
            fmt = torch.channels_last if nhwc else torch.contiguous_format
            self.ops.append(self._clone(template, name, out, fmt))
            self.copies[key] = out
            self.report.count("to_channels_last" if nhwc else "to_nchw")
        return self.copies[key]

    def _clone(self, template: Op, source: str, out: str, fmt: torch.memory_format) -> Op:
        attrs = {k: template.attrs[k] for k in _KEPT_ATTRS if k in template.attrs}
        attrs["provenance"] = "channels_last"
        suffix = "nhwc" if fmt == torch.channels_last else "nchw"
        return Op(self.names.fresh(f"{source}.to_{suffix}"), CLONE, (Ref(source),), {"memory_format": fmt},
                  outputs=[out], attrs=attrs)

    def _producer(self, name: str) -> Op:
        return next(op for op in self.ops if name in op.defined)
