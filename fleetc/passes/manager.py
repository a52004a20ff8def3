"""Runs an ordered list of passes with instruments around each, keeping one record per pass.

The passes edit one live Program in place: the manager copies the captured Program once, not once per pass.
Each record's Program (dump-ir, notebooks, `history.diff`) is rebuilt only when someone asks for it, by replaying
the passes from the nearest Program already built (`_Replay`), and so is its memory estimate; a compile nobody
inspects pays for neither (the last record's estimate is made at once: the compile report reads it). Passes are
deterministic, and the replay checks that: each rebuilt Program must have the op names and types, and the Var
names, that the live one had right after the same pass (`fingerprint`), else a PassError says which pass gave
something else; under `verify` (`fingerprint_arguments`), also the same op arguments, outputs and attributes.
The live Program also lets a pass hand its blocks' use-def indexes on to the next pass
(`fleetc.ir.usedef.keeping`): after each pass only the indexes that pass handed on survive.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any, Iterable

import sympy
import torch

from fleetc.errors import PassError
from fleetc.ir import usedef
from fleetc.ir.html import HtmlViewable
from fleetc.ir.liveness import MemoryEstimate, estimate_memory
from fleetc.ir.program import Program, Ref
from fleetc.ir.text_syntax import TORCH_CONSTANTS
from fleetc.passes.base import Pass, PassReport
from fleetc.passes.instruments import PassInstrument


def fingerprint(program: Program, arguments: bool = False) -> str:
    """A digest of the Program's structure: per block, its op names and types in order and its Var names. One
    cheap walk (no arguments visited), so the manager takes one after every pass to check replays against. With
    `arguments`, also every op's arguments, outputs and attributes: some 20x the cost (bench/README.md), so the
    manager takes that one only when asked (`fingerprint_arguments`, the compile's `verify`)."""
    digest = hashlib.blake2b(digest_size=16)
    for block in program.blocks:
        digest.update(f"#{block.idx}<{block.parent_idx}|".encode())
        digest.update("\n".join(f"{op.name}={op.type}" for op in block.ops).encode())
        digest.update("|".join(block.vars).encode())
        if arguments:
            digest.update(_ARGUMENTS.encode([(op.args, op.kwargs, op.outputs, op.attrs) for op in block.ops]).encode())
    return digest.hexdigest()


def _argument_leaf(value: Any) -> str:
    """What the digest sees of a value JSON has no form for: a Var reference by name, a dtype, device, layout,
    memory format or symbolic size by its text, anything else by its type alone (never its repr, which may hold
    an address that differs between a run and its replay)."""
    if type(value) is Ref:
        return f"\0%{value.name}"
    if isinstance(value, (torch.dtype, torch.device, *TORCH_CONSTANTS, sympy.Basic)):
        return f"\0<{value}>"
    return f"\0<{type(value).__qualname__}>"


# C-speed walk of the nested arguments; keys JSON cannot hold are skipped, so a digest never fails.
_ARGUMENTS = json.JSONEncoder(default=_argument_leaf, check_circular=False, skipkeys=True, separators=(",", ":"))


class UnifiedDiff(HtmlViewable, str):
    """`history.diff(...)`: a plain string (print it, compare it) with a coloured notebook view."""


class PassRecord(HtmlViewable):
    """One step of the pass order: the pass, the Program after it, its report and how long it took.

    The Program is either given, or built on first access by the run's `_Replay` (step `replay[1]`); the memory
    estimate, when not given, is made from the Program on first access."""

    def __init__(self, name: str, program: Program | None, report: PassReport, seconds: float,
                 memory: MemoryEstimate | None, replay: tuple[_Replay, int] | None = None):
        if (program is None) == (replay is None):
            raise ValueError("a PassRecord needs either its Program or the replay that rebuilds it")
        self.name, self.report, self.seconds = name, report, seconds
        self._program, self._replay, self._memory = program, replay, memory
        self.previous: PassRecord | None = None  # set by History

    @property
    def program(self) -> Program:
        if self._program is None:
            replay, step = self._replay
            self._program, self._replay = replay.program(step), None
        return self._program

    @property
    def memory(self) -> MemoryEstimate:
        if self._memory is None:
            self._memory = estimate_memory(self.program)
        return self._memory

    def keep(self, program: Program) -> None:
        """Hold `program` as this record's Program (the manager's live one, after the last pass)."""
        self._program, self._replay = program, None

    def summary(self) -> str:
        """Whether it changed, statistics, estimated peak: no timing, so dumps of two runs diff cleanly."""
        return f"{self.report.summary()}; estimated peak {self.memory.peak_bytes / 2**20:.2f} MiB"

    def header(self) -> str:
        return f"# constructed by {self.name} ({self.seconds * 1000:.1f} ms): {self.summary()}"

    def __str__(self) -> str:
        return f"{self.header()}\n{self.program}"

    def __repr__(self) -> str:
        built = "built" if self._program is not None else "rebuilt on access"
        return f"PassRecord({self.name!r}, {self.report.summary()!r}, program {built})"


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


class _Replay:
    """Rebuilds the Program after each pass of one manager run, on request: the passes run again, from a copy of the
    nearest Program already built, and every Program on the way is kept (so walking the whole history replays each
    pass once). A disabled pass shares the Program before it, as in the run."""

    def __init__(self, base: Program, config: Any, arguments: bool = False):
        self.config, self.arguments = config, arguments
        self.steps: list[tuple[Pass | None, str]] = []  # (pass, or None where disabled; fingerprint after it)
        self.built: dict[int, Program] = {-1: base}

    def add(self, p: Pass | None, program: Program) -> int:
        """Note that step `len(steps)` ran `p` (None: disabled) and left `program`; returns the step."""
        self.steps.append((p, fingerprint(program, self.arguments)))
        return len(self.steps) - 1

    def program(self, step: int) -> Program:
        if step in self.built:
            return self.built[step]
        start = max(i for i in self.built if i < step)
        program = self.built[start]
        for i in range(start + 1, step + 1):
            p, expected = self.steps[i]
            if p is not None:
                try:
                    program, _ = p.run(program.clone(), self.config)
                except Exception as exc:
                    raise PassError(f"replaying pass {p.name!r} to rebuild the history's Program after it failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
                if fingerprint(program, self.arguments) != expected:
                    raise PassError(f"replaying pass {p.name!r} to rebuild the history's Program after it gave a "
                                    "different Program than the compile did: the pass is not deterministic")
            self.built[i] = program
        return program


class PassManager:
    """Applies passes in order to one live Program (a copy of the one given, which stays as it was); the records
    of the passes before the last rebuild their Programs when asked (`_Replay`); `fingerprint_arguments` makes
    that replay check op arguments and attributes too."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[PassInstrument] = (),
                 disabled: Iterable[str] = (), fingerprint_arguments: bool = False):
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.disabled = set(disabled)
        self.fingerprint_arguments = fingerprint_arguments

    def run(self, program: Program, config: Any, history: History) -> Program:
        replay = _Replay(program, config, self.fingerprint_arguments)
        live = program.clone()
        with usedef.keeping(live):
            for p in self.passes:
                if p.name in self.disabled:
                    report = PassReport(p.name, skipped_reason="disabled by the user (disable_passes)")
                    step = replay.add(None, live)
                    history.append(PassRecord(p.name, None, report, 0.0, None, (replay, step)))
                    continue
                for instrument in self.instruments:
                    instrument.before_pass(p.name, live)
                start = time.perf_counter()
                try:
                    live, report = p.run(live, config)
                except PassError:
                    raise
                except Exception as exc:
                    raise PassError(f"pass {p.name!r} failed: {type(exc).__name__}: {exc}") from exc
                seconds = time.perf_counter() - start
                for instrument in self.instruments:
                    instrument.after_pass(p.name, live, report, seconds)
                usedef.pass_done(live)
                step = replay.add(p, live)
                history.append(PassRecord(p.name, None, report, seconds, None, (replay, step)))
        if self.passes:
            history[-1].keep(live)
            history[-1].memory  # noqa: B018 (estimated now, before anyone edits the final Program)
        return live
