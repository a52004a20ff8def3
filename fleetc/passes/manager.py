"""Runs an ordered list of passes with instruments around each, keeping one record per pass."""
from __future__ import annotations

import difflib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterable

from fleetc.errors import PassError
from fleetc.ir.html import HtmlViewable
from fleetc.ir.liveness import MemoryEstimate, estimate_memory
from fleetc.ir.program import Program
from fleetc.passes.base import Pass, PassReport
from fleetc.passes.instruments import PassInstrument


class UnifiedDiff(HtmlViewable, str):
    """`history.diff(...)`: a plain string (print it, compare it) with a coloured notebook view."""


@dataclass
class PassRecord(HtmlViewable):
    """One step of the pass order: the pass, the Program after it, its report and how long it took."""

    name: str
    program: Program
    report: PassReport
    seconds: float
    memory: MemoryEstimate
    previous: PassRecord | None = field(default=None, repr=False, compare=False)  # set by History

    def summary(self) -> str:
        """Whether it changed, statistics, estimated peak: no timing, so dumps of two runs diff cleanly."""
        return f"{self.report.summary()}; estimated peak {self.memory.peak_bytes / 2**20:.2f} MiB"

    def header(self) -> str:
        return f"# constructed by {self.name} ({self.seconds * 1000:.1f} ms): {self.summary()}"

    def __str__(self) -> str:
        return f"{self.header()}\n{self.program}"


class History(HtmlViewable, Sequence):
    """Every intermediate Program in pass order; index by position or by pass name."""

    def __init__(self, records: Iterable[PassRecord] = ()):
        self._records: list[PassRecord] = []
        for record in records:
            self.append(record)

    def append(self, record: PassRecord) -> None:
        record.previous = self._records[-1] if self._records else None
        self._records.append(record)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            for record in self._records:
                if record.name == key:
                    return record
            raise KeyError(f"no pass named {key!r} in this history; passes: {self.names()}")
        return self._records[key]

    def names(self) -> list[str]:
        return [r.name for r in self._records]

    def index_of(self, key: int | str) -> int:
        return key if isinstance(key, int) else self.names().index(self[key].name)

    def diff(self, key: int | str, base: int | str | None = None) -> UnifiedDiff:
        """Unified diff of the Program before and after one pass, or between passes `base` and `key`."""
        i = self.index_of(key) % len(self)
        if base is None and i == 0:
            return UnifiedDiff("")
        j = i - 1 if base is None else self.index_of(base) % len(self)
        before, after = str(self._records[j].program), str(self._records[i].program)
        names = ((f"before {self._records[i].name}", f"after {self._records[i].name}") if base is None
                 else (f"after {self._records[j].name}", f"after {self._records[i].name}"))
        return UnifiedDiff("".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), *names)))

    def __repr__(self) -> str:
        return f"History({self.names()})"


class PassManager:
    """Applies passes in order; each gets a copy, so every history snapshot stays intact."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[PassInstrument] = (),
                 disabled: Iterable[str] = ()):
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.disabled = set(disabled)

    def run(self, program: Program, config: Any, history: History) -> Program:
        for p in self.passes:
            if p.name in self.disabled:
                report = PassReport(p.name, skipped_reason="disabled by the user (disable_passes)")
                history.append(PassRecord(p.name, program, report, 0.0, history[-1].memory))
                continue
            for instrument in self.instruments:
                instrument.before_pass(p.name, program)
            start = time.perf_counter()
            try:
                program, report = p.run(program.clone(), config)
            except PassError:
                raise
            except Exception as exc:
                raise PassError(f"pass {p.name!r} failed: {type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - start
            for instrument in self.instruments:
                instrument.after_pass(p.name, program, report, seconds)
            history.append(PassRecord(p.name, program, report, seconds, estimate_memory(program)))
        return program
