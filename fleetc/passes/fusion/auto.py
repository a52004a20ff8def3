"""Automatic vertical fusion: chains of pointwise aten ops (plus an optional trailing reduction) → one op.

Every decision about *what* may fuse lives in one overridable object, `FusionChoices` (as Inductor's
`InductorChoices` does): subclass it and pass an instance to `AutoFusion(choices)`, or install it for
every compile with `set_fusion_choices`. The pass itself only walks each block in order, grows groups
from producer to consumer as the choices allow, and rewrites each group worth fusing into one
`fleetc.fused_elementwise` op placed where its first op was.

Placement rule (it keeps every rewrite legal without reordering other ops): an op may join a group
only when every value it reads from outside the group already exists where the group starts, and no
op between the group's start and it writes a persistable Var it reads.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetc.ir.program import Block, Op, Program, Ref, VarKind, map_refs
from fleetc.ir.registry import resolve_callable
from fleetc.ir.usedef import Names, UseDef, handed_on
from fleetc.ops.fused_elementwise import OPERAND_PREFIX, operand, short_op_name
from fleetc.ops.pointwise import REDUCTIONS, can_lower
from fleetc.passes.base import PassReport
from fleetc.passes.cleanup.dce import drop_unused_temporaries

FUSED_OP_TYPE = "fleetc.fused_elementwise"


@dataclass
class FusionGroup:
    """Ops (indices into one block, in program order) that become one fused op."""

    block: Block
    members: list[int]
    shape: tuple
    closed: bool = False  # a trailing reduction ends the group
    defined: set[str] = field(default_factory=set)

    def ops(self) -> list[Op]:
        return [self.block.ops[i] for i in self.members]


class FusionChoices:
    """The auto-fusion heuristic: which ops count as pointwise, what may join a group, what is worth fusing.

    - pointwise: an aten OpOverload tagged `torch.Tag.pointwise`, not RNG (`nondeterministic_seeded`:
      fusing it would change when random numbers are drawn), with one output, that the Triton code
      generator can express (so every fused group has a kernel), on float or bool tensors of known shape;
    - a trailing reduction (`sum.dim_IntList`, `mean.dim` without a dtype) may end a group;
    - ops join a group only with the same op_role and op_device (never across forward/backward/optimize,
      nor across device_guard stages), and only within one block;
    - broadcasting: every op of a group produces the group's full shape; inputs may be smaller when they
      broadcast to it (bias vectors, scalars, masks);
    - size: at most `max_group_ops` ops per group; a group is worth fusing with at least `min_group_ops`.
    """

    max_group_ops: int = 16
    min_group_ops: int = 2
    tensor_dtypes: frozenset[str] = frozenset({"float32", "float16", "bfloat16", "bool"})

    def _tensor_inputs_ok(self, program: Program, block: Block, op: Op) -> bool:
        for name in op.inputs:
            var = program.var(name, block.idx)
            if var.shape is None or var.dtype not in self.tensor_dtypes:
                return False
            if not all(isinstance(d, int) for d in var.shape):
                return False
        return True

    def _output(self, program: Program, block: Block, op: Op):
        if len(op.outputs) != 1 or op.outputs[0] is None:
            return None
        var = program.var(op.outputs[0], block.idx)
        if var.kind is not VarKind.TEMP or var.shape is None or var.dtype not in self.tensor_dtypes:
            return None
        return var

    def is_pointwise(self, program: Program, block: Block, op: Op) -> bool:
        if not op.type.startswith("aten.") or op.sub_block is not None:
            return False
        tags = resolve_callable(op.type).tags
        if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
            return False
        out = self._output(program, block, op)
        if out is None or not op.inputs or not self._tensor_inputs_ok(program, block, op):
            return False
        constants = [v for v in (*op.args, *op.kwargs.values()) if not isinstance(v, Ref)]
        if any(isinstance(v, str) and v.startswith(OPERAND_PREFIX) for v in constants):
            return False  # would read as an operand inside the fused expression
        return can_lower(op.type, op.args, op.kwargs, out.dtype)

    def is_reduction(self, program: Program, block: Block, op: Op) -> bool:
        if op.type not in REDUCTIONS or op.kwargs.get("dtype") is not None or len(op.args) > 3:
            return False
        return self._output(program, block, op) is not None and self._tensor_inputs_ok(program, block, op)

    def same_place(self, a: Op, b: Op) -> bool:
        """Ops of one group share role and device stage."""
        return a.role == b.role and a.attrs.get("op_device", "") == b.attrs.get("op_device", "")

    def broadcasts_to(self, shape: tuple, group_shape: tuple) -> bool:
        try:
            return tuple(torch.broadcast_shapes(shape, group_shape)) == tuple(group_shape)
        except RuntimeError:
            return False

    def can_join(self, program: Program, group: FusionGroup, op: Op, reduction: bool) -> bool:
        """Whether `op` (reading a value of `group`) may join it; placement legality is the pass's job."""
        if group.closed or len(group.members) >= self.max_group_ops:
            return False
        if not self.same_place(group.ops()[0], op):
            return False
        inputs = [program.var(n, group.block.idx) for n in op.inputs]
        if reduction:
            return tuple(program.var(op.args[0].name, group.block.idx).shape) == tuple(group.shape)
        out = program.var(op.outputs[0], group.block.idx)
        return tuple(out.shape) == tuple(group.shape) and all(self.broadcasts_to(v.shape, group.shape)
                                                                for v in inputs)

    def can_start(self, program: Program, block: Block, op: Op) -> bool:
        """A pointwise op starts a group when its inputs broadcast to its output."""
        out = program.var(op.outputs[0], block.idx)
        return all(self.broadcasts_to(program.var(n, block.idx).shape, out.shape) for n in op.inputs)

    def worth_fusing(self, group: FusionGroup) -> bool:
        return len(group.members) >= self.min_group_ops


_current_choices = FusionChoices()


def set_fusion_choices(choices: FusionChoices) -> FusionChoices:
    """Install the heuristic that AutoFusion uses by default; returns the previous one (to restore it)."""
    global _current_choices
    previous, _current_choices = _current_choices, choices
    return previous


def _as_tuples(value: Any) -> Any:
    """Lists → tuples, recursively: step descriptions must be hashable (the reference caches on them)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def _common_module_path(ops: list[Op]) -> str:
    paths = [op.module_path.split(".") if op.module_path else [] for op in ops]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


class AutoFusion:
    name = "auto_fusion"
    enabled_by = 'build_strategy.enable_auto_fusion'
    summary = "fuse chains of pointwise ops (and a trailing reduction) into fleetc.fused_elementwise ops"
    reads: tuple[str, ...] = ("build_strategy.enable_auto_fusion",)

    def __init__(self, choices: FusionChoices | None = None):
        self.choices = choices

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]:
        report = PassReport(self.name)
        choices = self.choices or _current_choices
        fused_index = 0
        names = Names(program)
        for block in program.blocks:
            usedef = handed_on(program, block) or UseDef(program, block)  # the named fusions' index
            groups = [g for g in self._form_groups(program, usedef, choices) if choices.worth_fusing(g)]
            if not groups:
                continue
            fused_index = self._rewrite(program, usedef, groups, fused_index, names, report)
        if not report.stats and "dynamic" in program.metadata:
            report.skipped_reason = ("the Program has symbolic shapes (dynamic dims), and fused_elementwise kernels "
                                     "are generated for constant sizes: ops on tensors of symbolic shape are not "
                                     "fused (compile with dynamic=False to fuse them)")
            return program, report
        if not report.stats:
            report.skipped_reason = ("no chain of pointwise ops to fuse: no pointwise op reads another's result "
                                     "within one role and device (see FusionChoices)")
            return program, report
        drop_unused_temporaries(program)
        report.changed = True
        return program, report

    # ----- grouping ----------------------------------------------------------------------------
    def _form_groups(self, program: Program, usedef: UseDef, choices: FusionChoices) -> list[FusionGroup]:
        """Grow groups in program order; positions and definers come from the block's use-def index."""
        block = usedef.block
        definer = {name: usedef.position[writers[0].name] for name, writers in usedef.writers.items()}
        owners = [i for i, op in enumerate(block.ops) if op.sub_block is not None]
        group_of: dict[int, FusionGroup] = {}
        groups: list[FusionGroup] = []
        for i, op in enumerate(block.ops):
            reduction = choices.is_reduction(program, block, op)
            if not reduction and not choices.is_pointwise(program, block, op):
                continue
            producers = sorted({definer[n] for n in op.inputs if definer.get(n, i) < i and definer[n] in group_of},
                               reverse=True)
            joined = False
            for p in producers:
                group = group_of[p]
                if reduction and op.args[0].name not in group.defined:
                    continue
                if choices.can_join(program, group, op, reduction) and self._placeable(usedef, group, i, definer,
                                                                                       owners):
                    group.members.append(i)
                    group.defined.update(op.defined)
                    group.closed = reduction
                    group_of[i] = group
                    joined = True
                    break
            if not joined and not reduction and choices.can_start(program, block, op):
                group = FusionGroup(block, [i], tuple(program.var(op.outputs[0], block.idx).shape),
                                    defined=set(op.defined))
                groups.append(group)
                group_of[i] = group
        return groups

    def _placeable(self, usedef: UseDef, group: FusionGroup, i: int, definer: dict[str, int],
                   owners: list[int]) -> bool:
        """Op i can move up to the group's first op: its outside inputs exist there and no op in between (not in
        the group) rewrites them or owns a sub-block. Asks the use-def index instead of scanning the ops between."""
        start = group.members[0]
        outside = [n for n in usedef.block.ops[i].inputs if n not in group.defined]
        if outside and bisect.bisect_left(owners, start) < bisect.bisect_left(owners, i):
            return False  # sub-block owners are never pointwise, so never group members
        members = set(group.members)
        for name in outside:
            if definer.get(name, -1) >= start and usedef.program.var(name, usedef.block.idx).kind is VarKind.TEMP:
                return False
            if any(start <= usedef.position[w.name] < i and usedef.position[w.name] not in members
                   for w in usedef.writers.get(name, ())):
                return False
        return True

    # ----- rewriting ---------------------------------------------------------------------------
    def _fused_op(self, group: FusionGroup, index: int, read_outside: set[str], names: Names) -> Op:
        ops = group.ops()
        values: dict[str, int] = {}
        inputs: list[str] = []
        for op in ops:
            for name in op.inputs:
                if name not in group.defined and name not in values:
                    values[name] = len(inputs)
                    inputs.append(name)
        steps = []
        for op in ops:
            to_operand = lambda r: operand(values[r.name])  # noqa: E731
            args = _as_tuples(map_refs(op.args, to_operand))
            kwargs = tuple((k, _as_tuples(map_refs(v, to_operand))) for k, v in op.kwargs.items())
            steps.append((op.type, args, kwargs))
            values[op.outputs[0]] = len(inputs) + len(steps) - 1
        outputs = [op.outputs[0] for op in ops if op.outputs[0] in read_outside]
        kinds = list(dict.fromkeys(short_op_name(op.type) for op in ops))
        name = names.fresh(f"fused_{'_'.join(kinds[:4])}_{index}")
        attrs = {"op_role": int(ops[0].role), "module_path": _common_module_path(ops),
                 "provenance": self.name, "fused_ops": [op.name for op in ops]}
        for key in ("op_device", "source", "forward_op"):
            value = next((op.attrs[key] for op in ops if op.attrs.get(key)), None)
            if value is not None:
                attrs[key] = value
        return Op(name, FUSED_OP_TYPE, tuple(Ref(n) for n in inputs),
                  {"steps": tuple(steps), "results": tuple(values[n] for n in outputs), "name": name},
                  outputs, attrs)

    def _rewrite(self, program: Program, usedef: UseDef, groups: list[FusionGroup], index: int, names: Names,
                 report: PassReport) -> int:
        """Replace each group read from outside by its fused op, standing where the group's first op stood."""
        fetched = set(program.fetches.values())
        replaced: dict[str, str] = {}
        for group in groups:
            ops = group.ops()
            members = {id(op) for op in ops}
            read_outside = {n for n in group.defined
                            if n in fetched or any(id(r) not in members for r in usedef.readers.get(n, ()))}
            if not read_outside:  # a dead chain: left as it is for dead-code elimination to drop
                continue
            fused = self._fused_op(group, index, read_outside, names)
            index += 1
            usedef.replace(ops, fused, usedef.position[ops[0].name])
            replaced.update({op.name: fused.name for op in ops})
            report.count("groups")
            report.count("ops_fused", len(group.members))
            report.count("reductions_fused", int(group.closed))
        usedef.compact()
        program.repoint_forward_ops(replaced)
        return index
