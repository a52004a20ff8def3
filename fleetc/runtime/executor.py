"""Runs a compiled Program: the generated step function, under no_grad, optionally measuring memory."""
from __future__ import annotations

from typing import Any

import torch

from fleetc.ir.program import Program
from fleetc.runtime.memory import MemoryTracker
from fleetc.runtime.pycodegen import generate_step


class Executable:
    """A Program ready to run; `run(state, feeds)` returns the fetches by key."""

    def __init__(self, program: Program, *, measure_memory: bool = False):
        self.program = program
        self.measure_memory = measure_memory
        self.generated = generate_step(program, measure_memory=measure_memory)
        self.last_measured_peak_bytes: int | None = None

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
