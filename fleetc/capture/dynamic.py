"""Dynamic dims at capture: which input dims are traced symbolically, and what the trace assumed about them.

`DynamicDims` names the dims of the step's tensor inputs that are traced as symbols (torch.export `Dim.AUTO`:
a dim the model forces to one size, e.g. a Linear's input features, silently stays static). After the trace,
`SymbolTable` reads torch's ShapeEnv: each surviving symbol gets a readable name (the user's, or "batch" for dim 0
and "seq" for dim 1), its value range, the input dim it is read from, and the guards (relations between the
symbols) the trace assumed. Var shapes and the Program's `metadata["dynamic"]` hold sympy expressions in those
names; the per-call check (fleetc/runtime/guards/shapes.py) evaluates them on the actual input sizes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

DEFAULT_DIM_NAMES = {0: "batch", 1: "seq"}
SIZE_ONE = " (the size-1 specialisation)"  # ends the `specialised` entry of a dim pinned at size 1


@dataclass
class DynamicDims:
    """Dims traced as symbols: tensor input position → {dim: name}."""

    dims: dict[int, dict[int, str]] = field(default_factory=dict)
    gave_up: str = ""  # why the dims marked automatically were dropped (the symbolic trace failed)
    pinned: frozenset[tuple[int, int]] = frozenset()  # (input, dim) traced at size 1 in this compile (see `pin`)
    bounds: dict[str, tuple[int, str]] = field(default_factory=dict)  # dim name → (upper bound, where it is from)
    shared: frozenset[str] = frozenset()  # names `dynamic_dims` gives to dims of two or more feeds: one symbol
    target: int | None = None  # the loss target's input position, when its dims carry the default names

    def __bool__(self) -> bool:
        return any(self.dims.values())

    def export_shapes(self, tensors: tuple[torch.Tensor, ...]) -> tuple:
        """torch.export's `dynamic_shapes` for a module whose forward is `forward(*tensors)`."""
        from torch.export import Dim  # torch._dynamo: imported only when tracing dynamically

        hints = {name: Dim.AUTO(max=bound) for name, (bound, _) in self.bounds.items()}  # a bounded range
        return (tuple({d: hints.get(name, Dim.AUTO) for d, name in self.dims.get(i, {}).items()
                       if (i, d) not in self.pinned} or None for i in range(len(tensors))),)

    def beyond_bounds(self, shapes: list[tuple[int, ...]], feed_names: list[str]) -> str | None:
        """The first marked dim of these input shapes above its upper bound, in words; None when all fit."""
        for i, marks in self.dims.items():
            for d, name in marks.items():
                if name in self.bounds and i < len(shapes) and d < len(shapes[i]):
                    bound, source = self.bounds[name]
                    if shapes[i][d] > bound:
                        return (f"dim {d} of {feed_names[i]} ({name}) is {shapes[i][d]}, above its bound {bound} "
                                f"({source}): the model has no positions past it")
        return None

    def size_one(self, shapes: list[tuple[int, ...]]) -> set[tuple[int, int]]:
        """The marked dims that are 1 in a call with these input shapes (and not pinned yet)."""
        return {(i, d) for i, marks in self.dims.items() for d in marks
                if i < len(shapes) and d < len(shapes[i]) and shapes[i][d] == 1} - self.pinned

    def pin(self, dims: set[tuple[int, int]]) -> DynamicDims:
        """These marks, with `dims` traced static at size 1 in one compile: the specialisation for a model that
        branches on a size being 1 (a guard `Ne(seq, 1)` broke, or the size-oblivious trace failed). The cache
        key stays the marked one; the Program's shape guards tell it from the symbolic one."""
        return DynamicDims(self.dims, self.gave_up, self.pinned | frozenset(dims), self.bounds, self.shared,
                           self.target)

    def ties(self, shapes: list[tuple[int, ...]]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Pairs of (input, dim) traced as one symbol: each dim of a `shared` name, tied to the first one of that
        name, and each dim of the loss target tied to the same dim of the first input when both have the same
        name (the labels' seq is the input's); only where the example's sizes are equal (else separate symbols)."""
        first: dict[str, tuple[int, int]] = {}
        pairs = []
        if self.target:
            pairs = [((0, d), (self.target, d)) for d, name in self.dims.get(self.target, {}).items()
                     if self.dims.get(0, {}).get(d) == name and d < len(shapes[0]) and shapes[0][d] ==
                     shapes[self.target][d] and not {(0, d), (self.target, d)} & self.pinned]
        for i, marks in sorted(self.dims.items()):
            for d, name in sorted(marks.items()):
                if name not in self.shared or (i, d) in self.pinned:
                    continue
                if name not in first:
                    first[name] = (i, d)
                elif shapes[first[name][0]][first[name][1]] == shapes[i][d]:
                    pairs.append((first[name], (i, d)))
        return pairs

    def masked(self, position: int, shape: tuple[int, ...]) -> tuple:
        """`shape` with the dynamic dims of input `position` replaced by their names (the cache key's form)."""
        marks = self.dims.get(position, {})
        return tuple(marks.get(d, size) for d, size in enumerate(shape))


def _range(shape_env: Any, symbol: sympy.Symbol) -> list[int | None]:
    bounds = shape_env.var_to_range.get(symbol)
    if bounds is None:
        return [0, None]
    upper = bounds.upper
    return [int(bounds.lower), int(upper) if upper.is_Integer else None]


def _where(guard: Any) -> str:
    """Where a ShapeEnv guard was made: the user's frame when torch knows it, else torch's own."""
    frame = guard.sloc.maybe_user_loc or guard.sloc.framework_loc
    if frame is None or isinstance(frame, str):
        return frame or ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


class SymbolTable:
    """torch's shape symbols of one trace, renamed for the Program; what they are read from and what was assumed."""

    def __init__(self, fakes: tuple, feed_names: list[str], requested: DynamicDims):
        from torch._guards import detect_fake_mode

        self.shape_env = shape_env = detect_fake_mode(fakes).shape_env
        self.rename: dict[sympy.Symbol, sympy.Symbol] = {}
        self.dims: dict[str, list] = {}  # name → [feed, dim]: where its value is read on each call
        self.ranges: dict[str, list[int | None]] = {}
        self.hints: dict[str, int] = {}
        self.specialised: list[str] = []  # requested dims the model forced to one size
        self.bounded: dict[str, str] = {}  # name → where its upper bound is from (fleetc/capture/dim_bounds.py)
        taken: set[str] = set()
        for position, fake in enumerate(fakes):
            for dim, size in enumerate(fake.shape):
                wanted = requested.dims.get(position, {}).get(dim)
                expr = self._raw(size)
                if not isinstance(expr, sympy.Symbol):
                    if wanted is not None and isinstance(expr, sympy.Integer):
                        why = SIZE_ONE if (position, dim) in requested.pinned else ""
                        self.specialised.append(f"{feed_names[position]} dim {dim} ({wanted}) = {int(expr)}{why}")
                    continue
                root = shape_env.replacements.get(expr, expr)
                if not isinstance(root, sympy.Symbol):
                    continue
                if root not in self.rename:
                    base = wanted or DEFAULT_DIM_NAMES.get(dim, f"{feed_names[position]}_{dim}")
                    name, n = base, 1
                    while name in taken:
                        n += 1
                        name = f"{base}_{n}"
                    taken.add(name)
                    self.rename[root] = sympy.Symbol(name, integer=True, positive=True)
                    self.dims[name] = [feed_names[position], dim]
                    self.ranges[name] = _range(shape_env, root)
                    if wanted in requested.bounds:
                        self.bounded[name] = requested.bounds[wanted][1]
                    self.hints[name] = int(size.node.hint)
        # Symbols torch replaced by another (the target's batch dim equals the input's): each gets the name of the
        # input dim it is read from, and a guard says it equals its replacement.
        self.aliases: dict[str, list] = {}
        for position, fake in enumerate(fakes):
            for dim, size in enumerate(fake.shape):
                expr = self._raw(size)
                if isinstance(expr, sympy.Symbol) and expr not in self.rename:
                    name = re.sub(r"\W", "_", f"{feed_names[position]}_{dim}")
                    self.rename[expr] = sympy.Symbol(name, integer=True, positive=True)
                    self.aliases[name] = [feed_names[position], dim]
        self.guard_sources: dict[str, str] = {}  # guard → where the trace made it (file:line in function)
        self.guards = self._guards()

    def _raw(self, size: Any) -> sympy.Basic:
        return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))

    def expr(self, value: Any) -> int | sympy.Basic:
        """An int, or the sympy expression (in the Program's names) of a SymInt; for Var shapes and arguments."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = self.shape_env.simplify(value.node.expr).xreplace(self.rename)
        return int(expr) if expr.is_Integer else expr

    def _guards(self) -> list[str]:
        """The relations the trace assumed, in the Program's names: replaced symbols become equalities."""
        guards = []
        for symbol, replacement in self.shape_env.replacements.items():
            if symbol in self.rename:
                alias = self.rename[symbol]
                if alias.name in self.aliases:
                    guards.append(str(sympy.Eq(alias, replacement.xreplace(self.rename))))
        for guard in self.shape_env.guards:
            expr = self.shape_env.simplify(guard.expr).xreplace(self.rename)
            if expr in (sympy.true, sympy.false) or expr.free_symbols - set(self.rename.values()):
                continue  # settled by the replacements, or about a symbol no input dim gives
            text = str(expr)
            if text not in guards:
                guards.append(text)
                self.guard_sources[text] = _where(guard)
        return guards

    def metadata(self) -> dict:
        """What `metadata["dynamic"]` holds: JSON-ready, read by the shape check and the report."""
        return {"dims": self.dims, "ranges": self.ranges, "hints": self.hints, "guards": self.guards,
                "guard_sources": self.guard_sources, "aliases": self.aliases, "specialised": self.specialised, "bounded": self.bounded}
