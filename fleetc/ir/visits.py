"""A deterministic measure of compile work: how many times the IR's ops and Vars are looked at.

Wall-clock time is noisy on shared machines; the number of attribute reads of `Op` and `Var` objects is not. A
pass that rescans the block per rewrite reads quadratically many, one that keeps an index reads linearly many,
so the count's growth with model depth tells which a pass is (tests/test_compile_scaling.py).

Counting swaps in a counting `__getattribute__` on the two classes only inside `count_visits()`: outside it
the classes are untouched and cost nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fleetc.ir.program import Op, Var

_COUNTED = (Op, Var)


class VisitCounter:
    """Running total of Op/Var attribute reads while `count_visits()` is active."""

    def __init__(self) -> None:
        self.total = 0

    def _getattribute(self):
        counter = self
        read = object.__getattribute__

        def counting(obj, name):
            counter.total += 1
            return read(obj, name)

        return counting


@contextlib.contextmanager
def count_visits() -> Iterator[VisitCounter]:
    """Count every attribute read of an Op or Var inside the `with` block; yields the counter (read `.total`)."""
    if any("__getattribute__" in cls.__dict__ for cls in _COUNTED):
        raise RuntimeError("count_visits() is already active (it does not nest)")
    counter = VisitCounter()
    for cls in _COUNTED:
        cls.__getattribute__ = counter._getattribute()
    try:
        yield counter
    finally:
        for cls in _COUNTED:
            del cls.__getattribute__
