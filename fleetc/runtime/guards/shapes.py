"""The shape guards of a Program traced with symbolic dims, checked on every call before it runs.

A dynamic Program (`metadata["dynamic"]`, see fleetc/capture/dynamic.py) serves every input size its guards
allow: each feed's rank and static dims, each symbol's range (torch traces sizes 0 and 1 as specialisations, so a
range starts at 2), and the relations the trace assumed (`Eq(batch*seq, batch_2*seq_2)`). The check reads the
symbols' values from the input sizes, then tests everything as one generated Python expression; `failure()` names
the first dim and guard broken, in words.
"""
from __future__ import annotations

import math

import sympy

from fleetc.capture.dynamic import SIZE_ONE
from fleetc.ir.program import Program, VarKind
from fleetc.ir.sym_parse import make_symbols, parse_sym
from fleetc.ir.symbolic import sym_value

# sympy functions a guard may use → plain Python (the generated check runs on ints, never on sympy objects).
_PY = {"Eq": lambda a, b: a == b, "Ne": lambda a, b: a != b, "Mod": lambda a, b: a % b,
       "floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min, "FloorDiv": lambda a, b: a // b,
       "PythonMod": lambda a, b: a % b, "Abs": abs}


class ShapeGuards:
    """The shape guards of one dynamic Program, bound to the positions of its feeds among the tensor inputs."""

    def __init__(self, program: Program):
        info = program.metadata["dynamic"]
        self.info = info
        self.feeds = [name for name in program.feeds if program.var(name).kind is VarKind.DATA]  # the step's tensors
        self.shapes = [program.var(name).shape for name in self.feeds]
        position = {name: i for i, name in enumerate(self.feeds)}
        self.sources = {name: (position[feed], dim) for name, (feed, dim) in {**info["aliases"], **info["dims"]}.items()}
        symbols = make_symbols({name: {"integer": True, "positive": True} for name in self.sources})
        self.relations = [(text, parse_sym(text, symbols)) for text in info["guards"]]
        self._fn = self._generate()

    def _generate(self):
        """`ok(shapes)`: every guard as one boolean expression over the input shapes (a tuple of torch.Size)."""
        names = {name: f"shapes[{i}][{d}]" for name, (i, d) in self.sources.items()}
        clauses = [f"len(shapes) == {len(self.shapes)}"]
        for i, shape in enumerate(self.shapes):
            clauses.append(f"len(shapes[{i}]) == {len(shape)}")
            for d, size in enumerate(shape):
                if isinstance(size, int):
                    clauses.append(f"shapes[{i}][{d}] == {size}")
                elif not (isinstance(size, sympy.Symbol) and self.sources.get(size.name) == (i, d)):
                    clauses.append(f"shapes[{i}][{d}] == {self._py(size, names)}")
        for name, (low, high) in self.info["ranges"].items():
            clauses.append(f"{low} <= {names[name]}" + (f" <= {high}" if high is not None else ""))
        clauses += [self._py(expr, names) for _, expr in self.relations]
        source = "def ok(shapes):\n    try:\n        return bool(" + "\n                and ".join(clauses) + \
                 ")\n    except IndexError:\n        return False\n"
        namespace = dict(_PY)
        exec(compile(source, "<fleetc shape guards>", "exec"), namespace)  # noqa: S102
        self.source = source
        return namespace["ok"]

    @staticmethod
    def _py(expr: sympy.Basic, names: dict[str, str]) -> str:
        text = str(expr.xreplace({s: sympy.Symbol(f"__{s.name}__") for s in expr.free_symbols}))
        for name, where in names.items():
            text = text.replace(f"__{name}__", where)
        return text

    def sizes(self, shapes: list[tuple]) -> dict[str, int]:
        """Each dim name's size in a call with these input shapes."""
        return {name: int(shapes[i][d]) for name, (i, d) in self.sources.items() if name in self.info["dims"]}

    def passes(self, shapes: list[tuple]) -> bool:
        return self._fn(shapes)

    def failure(self, shapes: list[tuple]) -> str | None:
        """The first guard `shapes` break, naming the dim: None when all pass."""
        if len(shapes) != len(self.shapes):
            return f"the Program takes {len(self.shapes)} tensor inputs, the call gave {len(shapes)}"
        for name, shape, got in zip(self.feeds, self.shapes, shapes):
            if len(got) != len(shape):
                return f"{name} has {len(got)} dims, the Program was compiled for {len(shape)}"
        values = {name: int(shapes[i][d]) for name, (i, d) in self.sources.items()}
        for name, (low, high) in self.info["ranges"].items():
            value = values[name]
            if value < low or high is not None and value > high:
                feed, dim = self.info["dims"][name]
                bound = f"{low} <= {name}" + (f" <= {high}" if high is not None else "")
                return f"dim {dim} of {feed} ({name}) is {value}, outside the guard {bound}"
        for name, shape, got in zip(self.feeds, self.shapes, shapes):
            for d, size in enumerate(shape):
                if sym_value(size, values) != got[d]:
                    return f"dim {d} of {name} is {got[d]}, the guard says {name}.size({d}) == {size}"
        for text, expr in self.relations:
            if not bool(expr.xreplace({s: values[s.name] for s in expr.free_symbols})):
                bound = ", ".join(f"{s.name}={values[s.name]}" for s in sorted(expr.free_symbols, key=str))
                return f"the guard {text} fails for {bound}"
        return None

    def size_one_branches(self, shapes: list[tuple]) -> set[tuple[int, int]]:
        """(input, dim) of the dims that are 1 in this call and named by a guard it breaks (`Ne(seq, 1)`): where
        the model branches on a size being 1, so the next compile traces them at size 1."""
        if len(shapes) != len(self.shapes) or any(len(got) != len(shape) for got, shape in zip(shapes, self.shapes)):
            return set()
        values = {name: int(shapes[i][d]) for name, (i, d) in self.sources.items()}
        broken = [name for name, (low, high) in self.info["ranges"].items()
                  if values[name] < low or high is not None and values[name] > high]
        for _, expr in self.relations:
            if not bool(expr.xreplace({s: values[s.name] for s in expr.free_symbols})):
                broken += [s.name for s in expr.free_symbols]
        return {self.sources[name] for name in broken if values[name] == 1}

    def summary(self) -> list[str]:
        """One line per symbol (where it is read, its range) and the relations, for `report()`."""
        lines = []
        for name, (feed, dim) in self.info["dims"].items():
            low, high = self.info["ranges"][name]
            bound = self.info.get("bounded", {}).get(name)
            lines.append(f"{name} = {feed}.size({dim}), {low} <= {name}" + (f" <= {high}" if high else "")
                         + (f" (the bound is {bound})" if bound and high else ""))
        lines += [f"{name} = {feed}.size({dim})" for name, (feed, dim) in self.info["aliases"].items()]
        sources = self.info.get("guard_sources", {})
        lines += [f"guard {text}" + (f" (made at {sources[text]})" if sources.get(text) else "")
                  for text, _ in self.relations]
        lines += [f"specialised{'' if text.endswith(SIZE_ONE) else ' (the model fixes it)'}: {text}"
                  for text in self.info["specialised"]]
        return lines
