"""Checks that a generated step's source, read back from the compile cache, is only what pycodegen emits.

The compile cache keeps the generated `step(state, feeds, mem)` so a warm start does not emit it again, but nothing
read from disk may run arbitrary code. Before such a source is compiled, `check_step_source` parses it (`ast`, no
evaluation) and accepts only the statement and expression forms pycodegen writes: assignments of names from
`state[...]`, `constants[...]`, `feeds` or a call, calls, `del`, `if`, `pass`, `mem.track`/`mem.drop` and one
`return {...}`. A call may only go to a global the caller lists (kernels resolved from the Program's own op types
and ops), every name read must be a parameter, a local assigned earlier, or such a global, and there is no
attribute access besides `mem.track`/`mem.drop`, no builtins, imports, lambdas or comprehensions. So a tampered
entry can at most call the Program's own ops on other arguments, which a tampered Program entry could do as well.
"""
from __future__ import annotations

import ast
from collections.abc import Collection

PARAMS = ("state", "feeds", "mem")
_MEM_METHODS = frozenset({"track", "drop"})
_SUBSCRIPTED = frozenset({"state", "constants"})


class StepSourceError(ValueError):
    """A stored step source holds something pycodegen never emits; the message names the line and the form."""


class _Checker:
    def __init__(self, kernels: Collection[str], values: Collection[str]):
        self.kernels, self.values = set(kernels), set(values)
        self.locals: set[str] = set(PARAMS)

    def fail(self, node: ast.AST, what: str) -> StepSourceError:
        return StepSourceError(f"line {getattr(node, 'lineno', '?')}: {what} is not a form the step generator emits")

    def statements(self, body: list[ast.stmt]) -> None:
        for node in body:
            self.statement(node)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            self.source(node.value)
            self.targets(node.targets[0])
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self.call(node.value)
        elif isinstance(node, ast.Delete) and all(isinstance(t, ast.Name) for t in node.targets):
            for target in node.targets:
                self.name(target)
        elif isinstance(node, ast.If) and not node.orelse:
            self.expr(node.test)
            self.statements(node.body)
        elif isinstance(node, ast.Pass):
            pass
        else:
            raise self.fail(node, f"a {type(node).__name__} statement")

    def targets(self, node: ast.expr) -> None:
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        for name in names:
            if not isinstance(name, ast.Name) or name.id in PARAMS or name.id in self.kernels | self.values:
                raise self.fail(node, "an assignment to anything but a fresh local name")
            self.locals.add(name.id)

    def source(self, node: ast.expr) -> None:
        """The right side of an assignment: `state['x']`, `constants['x']`, `feeds` or a call."""
        if isinstance(node, ast.Subscript):
            if not (isinstance(node.value, ast.Name) and node.value.id in _SUBSCRIPTED and node.value.id in
                    self.locals | self.values and isinstance(node.slice, ast.Constant)
                    and isinstance(node.slice.value, str)):
                raise self.fail(node, "a subscript other than state['name'] or constants['name']")
        elif isinstance(node, ast.Name) and node.id == "feeds":
            pass
        elif isinstance(node, ast.Call):
            self.call(node)
        else:
            raise self.fail(node, f"an assignment from a {type(node).__name__}")

    def call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            if not (isinstance(func.value, ast.Name) and func.value.id == "mem" and func.attr in _MEM_METHODS):
                raise self.fail(node, "a call of an attribute other than mem.track or mem.drop")
        elif not (isinstance(func, ast.Name) and func.id in self.kernels):
            raise self.fail(node, f"a call of {ast.unparse(func)!r}, which is not one of the Program's kernels")
        for arg in node.args:
            self.expr(arg)
        for keyword in node.keywords:
            if keyword.arg is None:
                raise self.fail(node, "a ** argument")
            self.expr(keyword.value)

    def expr(self, node: ast.expr) -> None:
        """An argument: names, constants, and lists, tuples and dicts (string keys) of them."""
        if isinstance(node, ast.Name):
            self.name(node)
        elif isinstance(node, ast.Constant):
            pass
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand,
                                                                                             ast.Constant):
            pass
        elif isinstance(node, (ast.List, ast.Tuple)):
            for element in node.elts:
                self.expr(element)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise self.fail(node, "a dict key that is not a string")
                self.expr(value)
        else:
            raise self.fail(node, f"a {type(node).__name__} expression")

    def name(self, node: ast.Name) -> None:
        if node.id not in self.locals and node.id not in self.values:
            raise self.fail(node, f"the name {node.id!r} (neither a local assigned before nor a listed global)")


def check_step_source(source: str, kernels: Collection[str], values: Collection[str]) -> ast.Module:
    """The parsed source when it is one `def step(state, feeds, mem)` made only of pycodegen's forms, calling only
    `kernels` and reading only locals, `values` and `kernels`; else StepSourceError. Compile the tree returned."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise StepSourceError(f"line {exc.lineno}: not Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise StepSourceError("not exactly one function definition")
    fn = tree.body[0]
    arguments = fn.args
    if (fn.name != "step" or fn.decorator_list or fn.returns is not None or arguments.posonlyargs
            or arguments.vararg or arguments.kwonlyargs or arguments.kwarg or arguments.defaults
            or [a.arg for a in arguments.args] != list(PARAMS) or any(a.annotation for a in arguments.args)):
        raise StepSourceError("not `def step(state, feeds, mem):`")
    *body, last = fn.body
    if not (isinstance(last, ast.Return) and isinstance(last.value, ast.Dict)):
        raise StepSourceError(f"line {last.lineno}: the step does not end in `return {{...}}`")
    checker = _Checker(kernels, values)
    checker.statements(body)
    checker.expr(last.value)
    return tree
