"""The bounded cache of compiled steps: found by key (input signature, …), kept only while its guards pass.

Every compile after a step kind's first is a recompile, logged with its reason (a new key, or the guard that
failed); with `on_guard_failure="error"` a recompile raises GuardError instead. At most `limit` Programs are kept
per step kind; the least recently used one goes first, and the log says so.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from fleetc.errors import GuardError
from fleetc.runtime.guards import GuardCheck, GuardRecord
from fleetc.runtime.guards.shapes import ShapeGuards

RECOMPILE_POLICIES = ("recompile", "error")
DEFAULT_CACHE_LIMIT = 8


class CachedStep(Protocol):
    guards: GuardCheck
    shapes: ShapeGuards | None  # a dynamic Program's shape guards, checked on the call's input shapes


Key = tuple[tuple[str, Any], ...]  # (what, value) parts, e.g. ("inputs", input_key(...))


def _shown(guards: dict[str, Any], target: str) -> str:
    """An argument's guarded value in words: an int fed as a size carrier by its value."""
    if target not in guards:
        return "not given"
    expected = guards[target]
    if isinstance(expected, dict) and expected.get("int_argument"):
        return f"{expected['shape'][0]} (an int argument, now traced as a size)"
    return repr(expected)


def _input_change(old: GuardRecord, new: GuardRecord) -> str | None:
    """The arguments whose guards differ between two records, in words (the first three)."""
    before = {g.target: g.expected for g in old.guards if g.kind in ("input", "constant_arg")}
    after = {g.target: g.expected for g in new.guards if g.kind in ("input", "constant_arg")}
    changes = []
    for where in sorted(set(before) | set(after)):
        if before.get(where) != after.get(where):
            changes.append(f"argument {where} changed: {_shown(before, where)} when compiled, "
                           f"now {_shown(after, where)}")
    return "; ".join(changes[:3]) + ("; …" if len(changes) > 3 else "") if changes else None


class StepCache:
    """Compiled steps by (step kind, key), most recently used last; the recompile log."""

    def __init__(self, limit: int = DEFAULT_CACHE_LIMIT, on_guard_failure: str = "recompile"):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"cache_limit must be a positive int, not {limit!r}")
        if on_guard_failure not in RECOMPILE_POLICIES:
            raise ValueError(f"on_guard_failure must be one of {RECOMPILE_POLICIES}, not {on_guard_failure!r}")
        self.limit = limit
        self.on_guard_failure = on_guard_failure
        self.compiles = 0  # Programs compiled so far, all step kinds (evicted ones included)
        self._entries: dict[str, OrderedDict[int, tuple[Key, CachedStep]]] = {"train": OrderedDict(),
                                                                               "eval": OrderedDict()}
        self._next_id = 0
        self.log: list[str] = []

    def lookup(self, kind: str, key: Key, shapes: list[tuple] = ()) -> tuple[CachedStep | None, str | None]:
        """(the cached step whose key matches and whose guards pass, None) or (None, why a compile is needed).
        `shapes` (the tensor inputs' sizes) are checked against a dynamic Program's shape guards."""
        entries = self._entries[kind]
        failure = None
        for entry_id, (entry_key, step) in reversed(entries.items()):
            if entry_key != key:
                continue
            fits = step.shapes is None or step.shapes.passes(shapes)
            if fits and step.guards.passes():
                entries.move_to_end(entry_id)
                return step, None
            failure = failure or (step.guards.failure() if fits else
                                  f"shape guard failed: {step.shapes.failure(shapes)}")
        if failure is None and entries:
            latest_key = next(reversed(entries.values()))[0]
            failure = next((f"{what} changed" for (what, value), (_, old) in zip(key, latest_key) if value != old),
                           None)
        return None, failure

    def size_one_branches(self, kind: str, key: Key, shapes: list[tuple]) -> set[tuple[int, int]]:
        """(input, dim) of the size-1 dims that the shape guards of this key's cached Programs reject: the dims a
        recompile traces at size 1 (see ShapeGuards.size_one_branches)."""
        return {where for entry_key, step in self._entries[kind].values() if entry_key == key and step.shapes
                for where in step.shapes.size_one_branches(shapes)}

    def add(self, kind: str, key: Key, step: CachedStep, reason: str | None, step_number: int, note: str = "") -> None:
        """Keep a freshly compiled step; log (or, under the "error" policy, refuse) it when it is a recompile
        (`note` is appended to the reason, e.g. the dims the new Program is symbolic in)."""
        entries = self._entries[kind]
        if entries:
            if reason is not None and reason.startswith("inputs changed"):
                previous = next(reversed(entries.values()))[1]
                reason = _input_change(previous.guards.record, step.guards.record) or reason
            line = f"step {step_number}: recompiled the {kind} step: {reason}{note}"
            if self.on_guard_failure == "error":
                raise GuardError(f"{line.partition(': ')[2]} (fleetc.compile(..., on_guard_failure='error') "
                                 "forbids recompiling; undo the change or compile with on_guard_failure='recompile')")
            self.log.append(line)
        self.compiles += 1
        entries[self._next_id] = (key, step)
        self._next_id += 1
        while len(entries) > self.limit:
            entries.pop(next(iter(entries)))
            self.log.append(f"step {step_number}: dropped the least recently used {kind} Program "
                            f"(cache_limit={self.limit})")

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())
