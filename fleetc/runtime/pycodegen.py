"""Generates straight-line Python for a Program: one call per op, temporaries freed after last use.

Interpreting op records one by one costs microseconds per op; a generated function costs one
local-variable call per op, which keeps fleetc's per-op overhead below eager PyTorch's.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fleetc.ir.constants import constant_value
from fleetc.ir.liveness import last_use_index
from fleetc.ir.program import CONDITIONAL_BLOCK, Block, Op, Program, Ref, VarKind
from fleetc.ir.registry import resolve_callable

_SIMPLE = (bool, int, str, type(None))


def returns_list(kernel: Callable) -> bool:
    """An aten op returning one Tensor[] (`_foreach_norm`): even a one-element result unpacks into its Var."""
    schema = getattr(kernel, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]"


def returned_outputs(program: Program, op: Op, block: Block) -> list[str | None]:
    """The outputs a call of `op` returns, in order: its temporaries (None for a result nobody reads); persistable
    outputs are updated in place and not returned (fleetc/ir/registry.py)."""
    names: list[str | None] = []
    for name in op.outputs:
        var = program.find_var(name, block.idx) if name else None
        if var is None or var.kind is VarKind.TEMP:
            names.append(name)
    return names


def unpacks(op: Op, returned: list[str | None], list_result: bool) -> bool:
    """Whether a call's result is a sequence to unpack into `returned`, rather than the one value itself;
    `list_result` is `returns_list` of the op's kernel."""
    return not (len(op.outputs) == 1 and len(returned) == 1 and not list_result)


@dataclass
class GeneratedStep:
    """The source of `step(state, feeds, mem)`, the globals it runs with, and the op each call line runs."""

    source: str
    globals: dict[str, Any]
    fn: Callable
    op_at_line: dict[int, Op]

    def failed_op(self, exc: BaseException) -> Op | None:
        """The op whose call raised `exc` inside this step, read from the traceback (nothing is tracked per op, so
        the step costs nothing more); None when the exception did not pass through the step's code."""
        tb, line = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code is self.fn.__code__:
                line = tb.tb_lineno
            tb = tb.tb_next
        return self.op_at_line.get(line) if line is not None else None


class _Emitter:
    def __init__(self, program: Program, measure_memory: bool, op_callables: dict[str, Callable], profile: bool):
        self.program = program
        self.measure = measure_memory
        self.profile = profile
        self.op_callables = op_callables
        self.lines: list[str] = []
        self.globals: dict[str, Any] = {}
        self.local_names: dict[str, str] = {}
        self.taken: set[str] = set()  # the identifiers in local_names' values (a set, so `local` stays O(1))
        self.kernel_names: dict[str, str] = {}
        self.op_at_line: dict[int, Op] = {}
        self.list_returning: dict[str, bool] = {}  # kernel global -> returns_list

    def local(self, var_name: str) -> str:
        """A valid, unique Python identifier for a Var."""
        if var_name not in self.local_names:
            ident = re.sub(r"\W", "_", var_name)
            if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
                ident = "v_" + ident
            ident = "v_" + ident if not ident.startswith("v_") else ident
            while ident in self.taken:
                ident += "_"
            self.local_names[var_name] = ident
            self.taken.add(ident)
        return self.local_names[var_name]

    def constant(self, value: Any) -> str:
        if isinstance(value, _SIMPLE) or (isinstance(value, float) and value == value and abs(value) != float("inf")):
            return repr(value)
        name = f"c{len(self.globals)}"
        self.globals[name] = value
        return name

    def expr(self, value: Any) -> str:
        if isinstance(value, Ref):
            return self.local(value.name)
        if isinstance(value, list):
            return "[" + ", ".join(self.expr(v) for v in value) + "]"
        if isinstance(value, tuple):
            return "(" + "".join(self.expr(v) + ", " for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in value.items()) + "}"
        return self.constant(value)

    def kernel(self, op: Op) -> str:
        """The global a call to `op` goes through: its own callable when it has one, else its type's."""
        if op.name in self.op_callables:
            name = "k_op_" + self.local(op.name)
            self.globals[name] = self.op_callables[op.name]
            return name
        op_type = op.type
        if op_type not in self.kernel_names:
            name = "k_" + re.sub(r"\W", "_", op_type)
            self.globals[name] = resolve_callable(op_type)
            self.kernel_names[op_type] = name
        return self.kernel_names[op_type]

    def returns_list(self, kernel: str) -> bool:
        """`returns_list` of a kernel global, asked once per global (it reads and prints the op's schema)."""
        if kernel not in self.list_returning:
            self.list_returning[kernel] = returns_list(self.globals[kernel])
        return self.list_returning[kernel]

    def emit_op(self, op: Op, block: Block, indent: str) -> None:
        if self.profile:
            self.globals["record_function"] = torch.profiler.record_function
            self.lines.append(f"{indent}with record_function({profile_label(op)!r}):")
            indent += "    "
        if op.type == CONDITIONAL_BLOCK:
            self.lines.append(f"{indent}if {self.expr(op.args[0])}:  # {op.name}")
            self.emit_block(self.program.blocks[op.sub_block], indent + "    ")
            return
        returned = returned_outputs(self.program, op, block)
        temps = [self.local(name) if name else "_" for name in returned]
        call = ", ".join([self.expr(a) for a in op.args] + [f"{k}={self.expr(v)}" for k, v in op.kwargs.items()])
        kernel = self.kernel(op)
        call = f"{kernel}({call})"
        self.op_at_line[len(self.lines) + 1] = op  # the line appended next, 1-based
        if not temps:
            self.lines.append(f"{indent}{call}  # {op.name}")
        elif not unpacks(op, returned, self.returns_list(kernel)):
            self.lines.append(f"{indent}{temps[0]} = {call}  # {op.name}")
        else:
            self.lines.append(f"{indent}{', '.join(temps)}, = {call}  # {op.name}")
        if self.measure:
            for t in temps:
                if t != "_":
                    self.lines.append(f"{indent}mem.track({t!r}, {t})")

    def emit_block(self, block: Block, indent: str) -> None:
        dead_after = last_use_index(self.program, block, set(self.program.fetches.values()))
        free_at: dict[int, list[str]] = {}
        for name, i in dead_after.items():
            free_at.setdefault(i, []).append(name)
        defined_here = {name for op in block.ops for name in op.defined}
        if not block.ops:
            self.lines.append(f"{indent}pass")
        for i, op in enumerate(block.ops):
            self.emit_op(op, block, indent)
            dead = sorted(self.local(n) for n in free_at.get(i, ()) if n in defined_here)
            if dead:
                self.lines.append(f"{indent}del {', '.join(dead)}")
                if self.measure:
                    self.lines.append(f"{indent}mem.drop({tuple(dead)!r})")

    def load_all(self, mapping: str, names: list[str]) -> None:
        """One statement binding each Var in `names` to `mapping[name]` (`state` or `constants`): a thousand
        persistables cost CPython one unpacking instead of a thousand subscript assignments to compile."""
        if names:
            keys = f"{mapping}_keys"
            self.globals[keys] = tuple(names)
            self.lines.append(f"    {''.join(self.local(n) + ', ' for n in names)}= map({mapping}.__getitem__, {keys})")

    def generate(self) -> str:
        program = self.program
        self.lines.append("def step(state, feeds, mem):")
        self.load_all("state", [var.name for var in program.persistables()])
        constants = {v.name: constant_value(program, v) for v in program.all_vars() if v.kind is VarKind.CONSTANT}
        if constants:
            self.globals["constants"] = constants
        self.load_all("constants", list(constants))
        if program.feeds:
            self.lines.append(f"    {''.join(self.local(n) + ', ' for n in program.feeds)}= feeds")
        if self.measure:
            for name in program.feeds:
                self.lines.append(f"    mem.track({self.local(name)!r}, {self.local(name)})")
        self.emit_block(program.global_block, "    ")
        fetches = ", ".join(f"{k!r}: {self.local(v)}" for k, v in program.fetches.items())
        self.lines.append(f"    return {{{fetches}}}")
        return "\n".join(self.lines) + "\n"


def profile_label(op: Op) -> str:
    """The `record_function` range an op runs under when profiled: its module path and Program op name (`fc1/addmm`)."""
    return f"{op.module_path}/{op.name}" if op.module_path else op.name


def profiler_active() -> bool:
    """Whether torch.profiler (or the autograd profiler) is recording: torch's global flag, or this thread's state."""
    return torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled()


def generate_step(program: Program, *, measure_memory: bool = False,
                  op_callables: dict[str, Callable] | None = None, profile: bool = False) -> GeneratedStep:
    """Compile the Program into a Python function `step(state, feeds, mem) -> {fetch key: value}`.

    `op_callables` maps op names to what runs them instead of their type's function (the CPU backend's
    per-op kernels). `profile` runs every op under a `record_function` range (`profile_label`), for torch.profiler."""
    emitter = _Emitter(program, measure_memory, op_callables or {}, profile)
    source = emitter.generate()
    namespace = dict(emitter.globals)
    exec(compile(source, f"<fleetc step {program.metadata.get('kind', '')}>", "exec"), namespace)
    return GeneratedStep(source, emitter.globals, namespace["step"], emitter.op_at_line)
