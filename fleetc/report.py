"""CompileReport: which passes changed the Program, which were skipped and why, their statistics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompileReport:
    """Readable when printed, structured for scripts.

    `applied`: passes that changed the Program, in order. `skipped`: pass or strategy field → reason.
    `stats`: pass → statistics. `decisions`: how conflicting strategy settings were resolved.
    `guards`: what the Program assumed (docs/guards.md). `recompiles`: every recompile so far, with its reason.
    """

    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    compile_seconds: float = 0.0
    decisions: list[str] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)  # pass → what it decided, in words
    ops_before: int = 0
    ops_after: int = 0
    kernels: Any = None  # the CPU backend's live KernelUsage: which fused ops ran a C++ kernel, which the reference
    guards: list[str] = field(default_factory=list)  # what the Program assumed, one line per kind of guard
    recompiles: list[str] = field(default_factory=list)  # the trainer's recompiles so far, each with its reason
    execution: list[str] = field(default_factory=list)  # how the runtime runs the steps (execution_strategy)
    compiles: int = 0  # Programs the trainer compiled so far (train and eval; see `recompiles` for why)
    cache: list[str] = field(default_factory=list)  # what this compile found in the on-disk compile cache
    repeated_blocks: list[str] = field(default_factory=list)  # numbered sibling modules identical up to renaming

    def __str__(self) -> str:
        lines = [f"fleetc compile report: {self.ops_before} → {self.ops_after} ops in {self.compile_seconds:.2f} s"]
        lines.append("applied: " + (", ".join(self.applied) or "none"))
        for name in self.applied:
            stats = ", ".join(f"{k}={v}" for k, v in sorted(self.stats.get(name, {}).items()))
            lines.append(f"  {name}: {stats or 'no statistics'}")
            lines += [f"    note: {note}" for note in self.notes.get(name, ())]
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {name}: {why}" for name, why in self.skipped.items()]
        if self.decisions:
            lines.append("strategy decisions:")
            lines += [f"  {d}" for d in self.decisions]
        if self.execution:
            lines.append("execution:")
            lines += [f"  {e}" for e in self.execution]
        if self.memory:
            lines.append(f"estimated peak memory: {self.memory['estimated_peak_bytes'] / 2**20:.2f} MiB")
        if self.kernels is not None and self.kernels.mode != "off":
            lines += self.kernels.lines()
        if self.guards:
            lines.append("guards (a change recompiles):")
            lines += [f"  {g}" for g in self.guards]
        if self.compiles:
            lines.append(f"Programs compiled so far: {self.compiles}")
        lines += [f"compile cache: {line}" for line in self.cache]
        lines += [f"repeated blocks: {line}" for line in self.repeated_blocks]
        if self.recompiles:
            lines.append("recompiles:")
            lines += [f"  {r}" for r in self.recompiles]
        return "\n".join(lines)
