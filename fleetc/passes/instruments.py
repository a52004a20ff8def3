"""Instruments wrapped around every pass by the manager: timing, verification, printing, dumping."""
from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING

from fleetc.ir.program import Program
from fleetc.ir.verifier import verify
from fleetc.passes.base import PassReport

if TYPE_CHECKING:
    from fleetc.ir.visits import VisitCounter


class PassInstrument:
    """Hooks the manager calls around each pass; subclasses override what they need."""

    def before_pass(self, name: str, program: Program) -> None:
        pass

    def after_pass(self, name: str, program: Program, report: PassReport, seconds: float) -> None:
        pass


class VerifyInstrument(PassInstrument):
    """Runs the IR verifier after every pass; a failure names the pass that broke the invariant."""

    def after_pass(self, name: str, program: Program, report: PassReport, seconds: float) -> None:
        verify(program, after_pass=name)


class PrintInstrument(PassInstrument):
    """Prints the Program after every pass, or only after passes that changed it."""

    def __init__(self, only_changed: bool = False, stream: IO[str] | None = None):
        self.only_changed = only_changed
        self.stream = stream or sys.stdout

    def after_pass(self, name: str, program: Program, report: PassReport, seconds: float) -> None:
        if self.only_changed and not report.changed:
            return
        print(f"// ----- after {name} ({seconds * 1000:.1f} ms) -----", file=self.stream)
        print(program, file=self.stream)


class VisitCountInstrument(PassInstrument):
    """Records, per pass, how many Op/Var attribute reads it made (fleetc.ir.visits): a deterministic work
    measure for scaling tests. Use it inside `count_visits()`, as the first instrument."""

    def __init__(self, counter: VisitCounter):
        self.counter = counter
        self.visits: dict[str, int] = {}
        self._start = 0

    def before_pass(self, name: str, program: Program) -> None:
        self._start = self.counter.total

    def after_pass(self, name: str, program: Program, report: PassReport, seconds: float) -> None:
        self.visits[name] = self.counter.total - self._start
