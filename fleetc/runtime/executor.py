"""Runs a compiled Program: the generated step function (or the multi-threaded scheduler), under no_grad, optionally
measuring memory."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.codegen.cpu.backend import KernelUsage, prepare, resolve_mode
from fleetc.errors import FleetcError
from fleetc.ir.program import Program
from fleetc.runtime.memory import MemoryTracker
from fleetc.runtime.pycodegen import GeneratedStep, generate_step, profiler_active
from fleetc.runtime.scheduler import ScheduledStep, worker_error


class Executable:
    """A Program ready to run; `run(state, feeds)` returns the fetches by key.

    `cpu_kernels` ("off", "background", "sync"; None reads $FLEETC_CPU_KERNELS) says whether fused ops on CPU
    tensors run generated C++ kernels (fleetc/codegen/cpu/backend.py); `kernel_usage` counts what ran.
    `num_threads` > 1 runs the ops on the multi-threaded scheduler (fleetc/runtime/scheduler.py); 1, the default, runs
    the generated straight-line function in Program order. Measuring memory always runs the straight-line function.
    An op that fails raises `ExecutionError` naming it, its module path and the user's source line, either way.
    Under torch.profiler every op runs inside a `record_function` range named by its module path and op name.
    """

    def __init__(self, program: Program, *, measure_memory: bool = False, cpu_kernels: str | None = None,
                 num_threads: int = 1):
        self.program = program
        self.measure_memory = measure_memory
        self.cpu = prepare(program, resolve_mode(cpu_kernels))
        self.generated = generate_step(program, measure_memory=measure_memory, op_callables=self.cpu.callables)
        self._profiled: GeneratedStep | None = None
        self.scheduled = (ScheduledStep(program, num_threads, self.cpu.callables)
                          if num_threads > 1 and not measure_memory else None)
        self.last_measured_peak_bytes: int | None = None

    @property
    def kernel_usage(self) -> KernelUsage:
        return self.cpu.usage

    @property
    def source(self) -> str:
        return self.generated.source

    def _step_function(self) -> GeneratedStep:
        """The generated function; under torch.profiler, its variant with a `record_function` range per op."""
        if not profiler_active():
            return self.generated
        if self._profiled is None:
            self._profiled = generate_step(self.program, measure_memory=self.measure_memory,
                                           op_callables=self.cpu.callables, profile=True)
        return self._profiled

    def run(self, state: dict[str, torch.Tensor], feeds: list[Any]) -> dict[str, Any]:
        if self.scheduled is not None:
            return self.scheduled.run(state, feeds)
        tracker = None
        if self.measure_memory:
            tracker = MemoryTracker(list(state.values()))
        step = self._step_function()
        with torch.no_grad():
            try:
                out = step.fn(state, feeds, tracker)
            except FleetcError:  # already names what failed
                raise
            except Exception as exc:  # the same ExecutionError as from a scheduler thread
                op = step.failed_op(exc)
                if op is None:
                    raise
                raise worker_error(op, exc) from exc
        if tracker is not None:
            self.last_measured_peak_bytes = tracker.peak
        return out
