"""The CPU backend for one Program: plans every fused op and the row-wise aten ops of ATEN_PLANNERS, builds
their kernels in parallel, switches ops over.

`prepare(program, mode)` plans each op whose type declares a CPU planner and returns `CpuKernels`: a callable
per planned op (by op name) for the runtime to call in place of the op type's function, and `usage`, which
counts per op how many calls ran the kernel and how many the aten reference. Modes:

- "off": nothing is planned; every fused op runs its aten reference.
- "background": kernels build in a thread pool (one compiler process per distinct kernel, all at once);
  until its kernels are loaded an op runs its reference; then a few calls alternate kernel and reference, timed,
  and the op keeps the faster (choice.py): fusion never runs a kernel that measured slower than aten.
- "sync": the same builds, waited for before the first step, and always the kernel: the tests' mode, so what
  ran is known.

Identical kernels (same source: the same activation at the same rank and dtypes in every layer) build once,
and every library is cached on disk (toolchain.py), so a warm cache only loads libraries. A kernel that fails
to build leaves its op on the reference with the compiler's message in the usage notes; nothing fails.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from fleetc.codegen.cpu import toolchain
from fleetc.codegen.cpu.choice import MeasuredSwitch
from fleetc.codegen.cpu.plan import CpuPlan, Unsupported
from fleetc.codegen.cpu.source import CppKernel
from fleetc.ir.program import Op, Program, Ref
from fleetc.ir.registry import import_target, op_def, registered_ops, resolve_callable

MODES = ("off", "background", "sync")

# aten ops that have a CPU kernel too (fleetc ops declare theirs where they are registered).
ATEN_PLANNERS = {
    "aten.native_layer_norm.default": "fleetc.codegen.cpu.rows:plan_layer_norm",
    "aten.native_layer_norm_backward.default": "fleetc.codegen.cpu.rows:plan_layer_norm_backward",
    "aten._softmax.default": "fleetc.codegen.cpu.rows:plan_softmax",
    "aten._softmax_backward_data.default": "fleetc.codegen.cpu.rows:plan_softmax_backward",
    "aten._log_softmax.default": "fleetc.codegen.cpu.rows:plan_log_softmax",
    "aten._log_softmax_backward_data.default": "fleetc.codegen.cpu.rows:plan_log_softmax_backward",
}
ENV_MODE = "FLEETC_CPU_KERNELS"


def resolve_mode(mode: str | None) -> str:
    """The mode asked for, else $FLEETC_CPU_KERNELS, else "off"; ValueError for an unknown one."""
    chosen = mode if mode is not None else os.environ.get(ENV_MODE, "off")
    if chosen not in MODES:
        source = "cpu_kernels" if mode is not None else f"${ENV_MODE}"
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, not {chosen!r}")
    return chosen


@dataclass
class OpUsage:
    """How one op ran: calls on its kernel and on its reference, and why it has no kernel (when it has none)."""

    op_type: str
    kernels: tuple[str, ...] = ()
    kernel_calls: int = 0
    reference_calls: int = 0
    note: str = ""
    exact: bool = False
    chosen: str = ""  # "kernel" or "reference" once a background-mode measurement chose (choice.py)


@dataclass
class KernelUsage:
    """Per op name: which implementation ran how often. Printed in `trainer.report()`."""

    mode: str
    ops: dict[str, OpUsage] = field(default_factory=dict)

    def implementation(self, op_name: str) -> str:
        """"kernel", "reference" or "mixed" (both ran: the kernel arrived mid-training), "not run"; after a
        measurement (background mode), the implementation it chose."""
        usage = self.ops[op_name]
        if usage.chosen:
            return usage.chosen
        if usage.kernel_calls and usage.reference_calls:
            return "mixed"
        return "kernel" if usage.kernel_calls else "reference" if usage.reference_calls else "not run"

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {"op_type": u.op_type, "implementation": self.implementation(name), "kernels": list(u.kernels),
                       "kernel_calls": u.kernel_calls, "reference_calls": u.reference_calls, "note": u.note,
                       "exact": u.exact} for name, u in self.ops.items()}

    def lines(self) -> list[str]:
        if not self.ops:
            return [f"cpu kernels ({self.mode}): no op in the Program has a CPU kernel"]
        counts: dict[str, int] = {}
        for name in self.ops:
            counts[self.implementation(name)] = counts.get(self.implementation(name), 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        lines = [f"cpu kernels ({self.mode}): {summary}"]
        for name, u in self.ops.items():
            what = f"{u.kernel_calls} kernel / {u.reference_calls} reference calls"
            kernels = f" [{', '.join(u.kernels)}]" if u.kernels else ""
            lines.append(f"  {name} ({u.op_type}): {self.implementation(name)}, {what}{kernels}"
                         + (f"; {u.note}" if u.note else ""))
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass
class CpuKernels:
    """What the runtime needs: a callable per planned op name, and the usage counts behind them."""

    callables: dict[str, Callable]
    usage: KernelUsage
    pending: list[Future] = field(default_factory=list)

    def wait(self) -> None:
        """Block until every kernel build has finished (loaded or failed)."""
        for future in self.pending:
            future.result()


_POOL: ThreadPoolExecutor | None = None
_BUILDS: dict[str, Future] = {}  # source hash → future of the loaded function (one build per distinct kernel)
_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="fleetc-cpu-build")
    return _POOL


def _build_and_load(kernel: CppKernel) -> Any:
    return toolchain.load_function(toolchain.build(kernel.name, kernel.source), kernel.name)


def build_async(kernel: CppKernel) -> Future:
    """The (shared) future of one kernel's loaded function."""
    with _LOCK:
        future = _BUILDS.get(kernel.source_hash)
        if future is None or (future.done() and future.exception() is not None):
            future = _BUILDS[kernel.source_hash] = _pool().submit(_build_and_load, kernel)
        return future


def planner_of(op_type: str) -> str | None:
    """The "module:function" planning `op_type`'s CPU kernel, or None."""
    if op_type.startswith("fleetc."):
        return op_def(op_type).cpu_kernel
    return ATEN_PLANNERS.get(op_type)


def plan_op(op: Op, program: Program, block_idx: int) -> CpuPlan:
    """The CPU plan of one op (Unsupported when its type has no planner or the planner refuses it).

    The planner gets, per positional argument, its Var (a list of Vars for a list of tensors, None otherwise)."""
    target = planner_of(op.type)
    if target is None:
        raise Unsupported(f"{op.type} has no CPU kernel")

    def var_of(arg: Any) -> Any:
        if isinstance(arg, Ref):
            var = program.var(arg.name, block_idx)
            if var.device != "cpu":
                raise Unsupported(f"{var.name} lives on {var.device}, not the CPU")
            if not all(isinstance(d, int) for d in var.shape or ()):
                raise Unsupported(f"{var.name} has a symbolic shape {var.shape}")
            return var
        if isinstance(arg, (list, tuple)) and arg and all(isinstance(a, Ref) for a in arg):
            return [var_of(a) for a in arg]
        return None

    return import_target(target)(op, [var_of(a) for a in op.args])


def planned_ops(program: Program) -> list[tuple[Op, CpuPlan | Unsupported]]:
    """Every op of a type with a CPU planner, in program order, with its plan or the reason it has none."""
    with_planner = {name for name, d in registered_ops().items() if d.cpu_kernel} | set(ATEN_PLANNERS)
    found: list[tuple[Op, CpuPlan | Unsupported]] = []
    for block, op in program.walk_ops():
        if op.type in with_planner:
            try:
                found.append((op, plan_op(op, program, block.idx)))
            except Unsupported as reason:
                found.append((op, reason))
    return found


def _attach(switch: MeasuredSwitch, plan: CpuPlan, futures: list[Future]) -> Future:
    """A future that binds the op's kernel into its switch once all its libraries are loaded."""
    done: Future = Future()
    remaining = [len(futures)]

    def finished(_: Future) -> None:
        with _LOCK:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            switch.usage.note = f"kernel build failed, runs the reference: {errors[0]}"
        else:
            switch.kernel = plan.bind([f.result() for f in futures])
        done.set_result(None)

    for future in futures:
        future.add_done_callback(finished)
    return done


def prepare(program: Program, mode: str) -> CpuKernels:
    """Plan, start building and wire up the CPU kernels of `program`'s fused ops (see the module docstring)."""
    usage = KernelUsage(mode)
    kernels = CpuKernels({}, usage)
    if mode == "off":
        return kernels
    compiler_missing = toolchain.compiler() is None
    for op, plan in planned_ops(program):
        op_usage = usage.ops[op.name] = OpUsage(op.type)
        switch = MeasuredSwitch(resolve_callable(op.type), op_usage, measure=mode == "background")
        kernels.callables[op.name] = switch
        if isinstance(plan, Unsupported):
            op_usage.note = str(plan)
            continue
        op_usage.kernels = tuple(k.name for k in plan.kernels)
        op_usage.exact = plan.exact
        if compiler_missing:
            op_usage.note = "no C++ compiler (set $CXX or install g++): runs the reference"
            continue
        kernels.pending.append(_attach(switch, plan, [build_async(k) for k in plan.kernels]))
    if mode == "sync":
        kernels.wait()
    return kernels
