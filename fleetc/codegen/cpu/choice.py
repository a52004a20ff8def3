"""Which implementation an op with a CPU kernel runs: the kernel, the aten reference, or the faster of the two.

A generated kernel is not always faster than the aten sequence it replaces (an activation whose inline
approximation costs more than aten's vectorized one, an epilogue whose pass is dwarfed by its matmuls), and
running a slower kernel would make fusion slow the step down. So in the "background" mode an op whose kernel
is loaded does not switch over blindly: its next calls alternate kernel and reference (`WARMUP` untimed calls
of each, then `TRIALS` timed calls of each), and from then on it runs whichever took less time at best. The
measurement uses the live calls of training, on the real arguments, so it costs nothing but the trial calls
of the slower implementation; the report states both times and the choice.

Time is the calling thread's CPU time when torch runs on one thread (`time.thread_time`: a preempted call on
a loaded machine is not charged for the time it waited), else wall time (several threads work for the call).
The "sync" mode (the tests') always runs the kernel, so what ran is known.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

WARMUP = 1  # untimed first calls of each implementation (layout caches, first-touch of new buffers)
TRIALS = 2  # timed calls of each implementation; the best of them is compared


def clock() -> Callable[[], float]:
    """The clock trial calls are timed with (see the module docstring)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


@dataclass
class Measurement:
    """The trial times (seconds) of each implementation, and the choice once both have `TRIALS` of them."""

    kernel: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)
    calls: int = 0  # trial calls made, warm-up included

    def next_is_kernel(self) -> bool:
        """Alternate kernel and reference, starting with the kernel."""
        return self.calls % 2 == 0

    def record(self, is_kernel: bool, seconds: float) -> None:
        if self.calls >= 2 * WARMUP:
            (self.kernel if is_kernel else self.reference).append(seconds)
        self.calls += 1

    @property
    def done(self) -> bool:
        return len(self.kernel) >= TRIALS and len(self.reference) >= TRIALS

    @property
    def kernel_wins(self) -> bool:
        return min(self.kernel) <= min(self.reference)

    def describe(self) -> str:
        chosen = "kernel" if self.kernel_wins else "reference"
        return (f"measured best of {TRIALS}: kernel {1e3 * min(self.kernel):.3f} ms, reference "
                f"{1e3 * min(self.reference):.3f} ms: runs the {chosen}")


class MeasuredSwitch:
    """An op's callable: the reference until the kernel is loaded, then (when measuring) trials of both, then the
    chosen implementation. Counts calls per implementation in `usage` (an OpUsage) and records the choice there."""

    def __init__(self, reference: Callable, usage: Any, measure: bool):
        self.reference = reference
        self.usage = usage
        self.measure = measure
        self.kernel: Callable | None = None
        self.chosen: Callable | None = None
        self.trials = Measurement()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chosen = self.chosen
        if chosen is not None:
            if chosen is self.kernel:
                self.usage.kernel_calls += 1
            else:
                self.usage.reference_calls += 1
            return chosen(*args, **kwargs)
        kernel = self.kernel
        if kernel is None:
            self.usage.reference_calls += 1
            return self.reference(*args, **kwargs)
        if not self.measure:
            self.chosen = kernel
            return self(*args, **kwargs)
        return self._trial(kernel, args, kwargs)

    def _trial(self, kernel: Callable, args: tuple, kwargs: dict) -> Any:
        is_kernel = self.trials.next_is_kernel()
        now = clock()
        start = now()
        result = (kernel if is_kernel else self.reference)(*args, **kwargs)
        self.trials.record(is_kernel, now() - start)
        if is_kernel:
            self.usage.kernel_calls += 1
        else:
            self.usage.reference_calls += 1
        if self.trials.done:
            self.chosen = kernel if self.trials.kernel_wins else self.reference
            self.usage.chosen = "kernel" if self.trials.kernel_wins else "reference"
            self.usage.note = (self.usage.note + "; " if self.usage.note else "") + self.trials.describe()
        return result
