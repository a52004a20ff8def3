"""Checks a Program's invariants; an error names the op, shows ops around it and the pass that broke it.

Invariants: every read Var is defined before use (persistables, feeds and constants are always defined; a
sub-block sees its parent's Vars defined before the owning op); one definer per temporary; op types
resolve; aten ops write only temporaries, or a persistable their schema updates in place (a traced
optimizer update's `exp_avg.lerp_(...)`), and their outputs' shapes and dtypes match what the op
computes (checked on fake tensors); sub-block references are valid, each sub-block has exactly one
owner, a conditional_block with one bool condition; within a block no optimize op comes before the
last backward op that feeds it; every constant has a value of its declared shape. `verify_usedef` checks a
block's use-def index (fleetc.ir.usedef) against its ops.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fleetc.errors import VerificationError
from fleetc.ir.constants import constant_problem
from fleetc.ir.liveness import block_reads, mutated_inputs
from fleetc.ir.meta_dtypes import real_results
from fleetc.ir.printer import format_op
from fleetc.ir.program import (
    CONDITIONAL_BLOCK,
    FED_KINDS,
    Block,
    Op,
    OpRole,
    Program,
    Ref,
    Var,
    VarKind,
    map_refs,
)
from fleetc.ir.registry import resolve_callable
from fleetc.ir.usedef import UseDef, check_consistent
from fleetc.ir.symbolic import hints, sym_value

CONTEXT_OPS = 2


def _fail(program: Program, block: Block, index: int, problem: str, after_pass: str | None) -> VerificationError:
    start, stop = max(0, index - CONTEXT_OPS), min(len(block.ops), index + CONTEXT_OPS + 1)
    context = []
    for i in range(start, stop):
        marker = ">>" if i == index else "  "
        context.append(f"  {marker} {format_op(block.ops[i], program, block.idx)}")
    where = f"after pass {after_pass!r}" if after_pass else "in the Program"
    op = block.ops[index]
    return VerificationError(f"IR invariant broken {where}: block {block.idx}, op {op.name!r} ({op.type}): "
                             f"{problem}\n" + "\n".join(context))


class _ShapeChecker:
    """Runs aten ops on fake tensors to compare declared output shapes/dtypes with computed ones."""

    def __init__(self, program: Program):
        self.program = program
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.fakes: dict[str, Any] = {}
        # A dynamic Program is checked at the sizes it was traced with (its symbols' hints).
        self.hints = hints(program)

    def shape(self, var: Var) -> tuple[int, ...]:
        return tuple(sym_value(d, self.hints) for d in var.shape or ())

    def fake(self, name: str, block_idx: int) -> Any:
        if name not in self.fakes:
            var = self.program.var(name, block_idx)
            if var.shape is None:
                return {"bool": True, "int64": 1, "float64": 1.0}.get(var.dtype, 1)
            with self.mode:
                self.fakes[name] = torch.empty(self.shape(var), dtype=var.torch_dtype, device=var.device)
        return self.fakes[name]

    def scalar(self, op: Op, block_idx: int) -> None:
        """Compute a host-scalar op on the values known (sizes at the traced sizes), for the ops that read it."""
        def to_value(ref: Ref) -> Any:
            return self.fake(ref.name, block_idx)

        try:
            result = resolve_callable(op.type)(*map_refs(op.args, to_value), **map_refs(op.kwargs, to_value))
        except ArithmeticError:  # hyperparameter arithmetic on stand-in values (1 - beta with beta=1): not a size
            return
        if op.outputs and op.outputs[0] is not None and isinstance(result, (int, float, bool)):
            self.fakes[op.outputs[0]] = result

    def check(self, op: Op, block_idx: int) -> str | None:
        fn = resolve_callable(op.type)
        to_fake = lambda r: self.fake(r.name, block_idx)  # noqa: E731
        args, kwargs = map_refs(op.args, to_fake), map_refs(op.kwargs, to_fake)
        try:
            with self.mode:
                result = fn(*args, **kwargs)
                results = real_results(op.type, args, list(result) if isinstance(result, (tuple, list)) else [result])
        except Exception as exc:  # the op cannot run on these inputs at all
            return f"does not accept its inputs: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if len(results) != len(op.outputs):
            return f"computes {len(results)} result(s) but declares {len(op.outputs)} output(s)"
        for name, value in zip(op.outputs, results):
            if name is not None and isinstance(value, (int, float, bool)):
                self.fakes[name] = value  # a size (`aten.sym_size`) later ops compute shapes from
            if name is None or not isinstance(value, torch.Tensor):
                continue
            var = self.program.var(name, block_idx)
            got = (tuple(value.shape), str(value.dtype).removeprefix("torch."))
            if got != (self.shape(var), var.dtype):
                return f"output {name!r} is declared {var.dtype}{list(var.shape or ())} but computes {got[1]}{list(got[0])}"
            self.fakes[name] = value
        return None


def verify(program: Program, *, after_pass: str | None = None, check_shapes: bool = True) -> None:
    """Raise VerificationError at the first broken invariant."""
    always_defined = {v.name for v in program.all_vars()
                      if v.persistable or v.kind in FED_KINDS or v.kind is VarKind.CONSTANT}
    problem = constant_problem(program)
    if problem:
        raise VerificationError(problem + (f" after pass {after_pass!r}" if after_pass else ""))
    for name in program.feeds:
        var = program.find_var(name)
        if var is None or var.kind not in FED_KINDS:
            raise VerificationError(f"feed {name!r} is not a data/hyper Var ({'after pass ' + after_pass if after_pass else ''})")
    op_names = [op.name for _, op in program.walk_ops()]
    if len(set(op_names)) != len(op_names):
        duplicated = sorted({n for n in op_names if op_names.count(n) > 1})
        raise VerificationError(f"op names are not unique: {duplicated}" + (f" after pass {after_pass!r}" if after_pass else ""))
    for block in program.blocks:
        for i, op in enumerate(block.ops):
            if op.attrs.get("forward_op", op.name) not in op_names:
                raise _fail(program, block, i, f"forward_op {op.attrs['forward_op']!r} names no op", after_pass)
    checker = _ShapeChecker(program) if check_shapes else None
    definer: dict[str, str] = {}
    _verify_block(program, program.global_block, set(always_defined), definer, checker, after_pass, set())
    owners = [op.sub_block for _, op in program.walk_ops() if op.sub_block is not None]
    for block in program.blocks[1:]:
        if owners.count(block.idx) != 1:
            raise VerificationError(f"block {block.idx} is owned by {owners.count(block.idx)} ops; a sub-block needs "
                                    "exactly one" + (f" (after pass {after_pass!r})" if after_pass else ""))
    for key, name in program.fetches.items():
        if program.find_var(name) is None:
            raise VerificationError(f"fetch {key!r} names an undefined Var {name!r}"
                                    + (f" after pass {after_pass!r}" if after_pass else ""))


def _verify_block(program: Program, block: Block, defined: set[str], definer: dict[str, str],
                  checker: _ShapeChecker | None, after_pass: str | None, visiting: set[int]) -> None:
    if block.idx in visiting:
        raise VerificationError(f"block {block.idx} is its own ancestor")
    visiting = visiting | {block.idx}
    last_backward_writer = {name: i for i, op in enumerate(block.ops) if OpRole.BACKWARD in op.role
                            for name in op.defined}
    for i, op in enumerate(block.ops):
        for name in op.inputs:
            if program.find_var(name, block.idx) is None:
                raise _fail(program, block, i, f"reads {name!r}, which no block in scope declares", after_pass)
            if name not in defined:
                raise _fail(program, block, i, f"reads {name!r} before any op defines it", after_pass)
        if (op.type == CONDITIONAL_BLOCK) != (op.sub_block is not None):
            raise _fail(program, block, i, f"only {CONDITIONAL_BLOCK} owns a sub-block, and it must", after_pass)
        try:
            resolve_callable(op.type) if op.sub_block is None else None
        except KeyError as exc:
            raise _fail(program, block, i, str(exc), after_pass) from None
        for name in op.defined:
            var = program.find_var(name, block.idx)
            if var is None:
                raise _fail(program, block, i, f"writes {name!r}, which no block in scope declares", after_pass)
            if var.kind is VarKind.TEMP:
                if name in definer:
                    raise _fail(program, block, i, f"temporary {name!r} is already defined by op {definer[name]!r}",
                                after_pass)
                definer[name] = op.name
            elif var.kind in FED_KINDS or var.kind is VarKind.CONSTANT:
                raise _fail(program, block, i, f"writes the {var.kind.value} Var {name!r}", after_pass)
            elif op.type.startswith("aten.") and name not in mutated_inputs(op):
                raise _fail(program, block, i, f"aten op writes the persistable {name!r}, but its schema writes no "
                            "such argument; update it in place (`add_`, `out=`) or use fleetc.assign", after_pass)
        if OpRole.OPTIMIZE in op.role:
            for name in block_reads(program, op):  # a conditional_block reads what its sub-block reads
                if last_backward_writer.get(name, -1) > i:
                    raise _fail(program, block, i, f"optimize op reads {name!r} before its last backward writer",
                                after_pass)
        if op.sub_block is not None:
            condition = op.args[0] if len(op.args) == 1 and isinstance(op.args[0], Ref) else None
            if condition is None or program.var(condition.name, block.idx).dtype != "bool":
                raise _fail(program, block, i, "a conditional_block takes exactly one argument, a bool Var",
                            after_pass)
            if not 0 < op.sub_block < len(program.blocks):
                raise _fail(program, block, i, f"sub_block {op.sub_block} does not exist", after_pass)
            sub = program.blocks[op.sub_block]
            if sub.parent_idx != block.idx:
                raise _fail(program, block, i, f"sub_block {sub.idx} has parent {sub.parent_idx}, not {block.idx}",
                            after_pass)
            _verify_block(program, sub, set(defined), definer, checker, after_pass, visiting)
        elif checker is not None and checker.hints and op.type.startswith("fleetc.scalar_"):
            checker.scalar(op, block.idx)  # a dynamic Program's size arithmetic: later shapes depend on it
        elif checker is not None and op.type.startswith("aten."):
            problem = checker.check(op, block.idx)
            if problem:
                raise _fail(program, block, i, problem, after_pass)
        defined.update(op.defined)


def verify_usedef(usedef: UseDef, *, after_pass: str | None = None) -> None:
    """Raise VerificationError when a block's use-def index disagrees with its ops (fleetc.ir.usedef)."""
    problem = check_consistent(usedef)
    if problem:
        where = f" after pass {after_pass!r}" if after_pass else ""
        raise VerificationError(f"use-def information of block {usedef.block.idx} is stale{where}: {problem}")
