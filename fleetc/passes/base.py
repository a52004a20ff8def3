"""What a pass is: a name, the strategy fields it reads, and `run(program, config) -> (program, report)`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetc.ir.program import Program


@dataclass
class PassReport:
    """What a pass did: statistics, whether the Program changed, and why not when its flag was on."""

    name: str
    changed: bool = False
    stats: dict[str, int] = field(default_factory=dict)
    skipped_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    reused_blocks: list[str] = field(default_factory=list)  # "30 of 31 blocks like … reused one plan", per group

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def summary(self) -> str:
        """`changed; fused=2, …` or `unchanged (why); …`: what a dump header and a pass fixture show."""
        stats = ", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())) or "no statistics"
        state = "changed" if self.changed else f"unchanged ({self.skipped_reason or 'nothing matched'})"
        return f"{state}; {stats}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "changed": self.changed, "stats": dict(self.stats),
                "skipped_reason": self.skipped_reason, "notes": list(self.notes)}


class Pass(Protocol):
    """A Program rewrite. `run` may mutate the Program it is given (the manager's live copy) and must be
    deterministic: the history rebuilds earlier Programs by running the passes again (fleetc/passes/manager.py).

    `enabled_by` names the strategy field (dotted, e.g. "build_strategy.fuse_bn_act_ops") whose True puts the
    pass in the order, or is None for a pass that is always there and decides for itself whether it has work.
    """

    name: str
    summary: str
    enabled_by: str | None
    reads: tuple[str, ...]

    def run(self, program: Program, config: Any) -> tuple[Program, PassReport]: ...
