"""Runs a compiled Program: the generated step function, under no_grad, optionally measuring memory."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.codegen.cpu.backend import KernelUsage, prepare, resolve_mode
from fleetc.ir.program import Program
from fleetc.runtime.memory import MemoryTracker
from fleetc.runtime.pycodegen import generate_step


class Executable:
    """A Program ready to run; `run(state, feeds)` returns the fetches by key.

    `cpu_kernels` ("off", "background", "sync"; None reads $FLEETC_CPU_KERNELS) says whether fused ops on CPU
    tensors run generated C++ kernels (fleetc/codegen/cpu/backend.py); `kernel_usage` counts what ran.
    """

    def __init__(self, program: Program, *, measure_memory: bool = False, cpu_kernels: str | None = None):
        self.program = program
        self.measure_memory = measure_memory
        self.cpu = prepare(program, resolve_mode(cpu_kernels))
        self.generated = generate_step(program, measure_memory=measure_memory, op_callables=self.cpu.callables)
        self.last_measured_peak_bytes: int | None = None

    @property
    def kernel_usage(self) -> KernelUsage:
        return self.cpu.usage

    @property
    def source(self) -> str:
        return self.generated.source

    def run(self, state: dict[str, torch.Tensor], feeds: list[Any]) -> dict[str, Any]:
        tracker = None
        if self.measure_memory:
            tracker = MemoryTracker(list(state.values()))
        with torch.no_grad():
            out = self.generated.fn(state, feeds, tracker)
        if tracker is not None:
            self.last_measured_peak_bytes = tracker.peak
        return out
