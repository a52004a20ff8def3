"""Parses a symbolic shape expression as sympy prints it ("2*s0 + 1", "Max(1, s0)") without evaluating any code.

Serialized Programs come from files others wrote, so `sympy.sympify` (which evaluates its input) must never see
them. The text is parsed by Python's `ast` (parsing runs nothing), every node is checked against a short list
(numbers, names, + - * / // % **, unary minus, and calls of a few sympy functions by name), and the sympy
expression is built from the checked tree.
"""
from __future__ import annotations

import ast
import operator

import sympy
from sympy.core.assumptions import _assume_defined

MAX_LENGTH = 2000  # shape expressions are short; a huge one is not a Program fleetc wrote
MAX_DEPTH = 50
MAX_EXPONENT = 64  # a number raised to a huge power would take unbounded time and memory
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {"Max": sympy.Max, "Min": sympy.Min, "floor": sympy.floor, "ceiling": sympy.ceiling, "Mod": sympy.Mod,
              "Abs": sympy.Abs, "sqrt": sympy.sqrt, "Eq": sympy.Eq, "Ne": sympy.Ne}
# Comparisons, for the shape guards of a dynamic Program (`batch <= 64`).
_COMPARE = {ast.Lt: sympy.Lt, ast.LtE: sympy.Le, ast.Gt: sympy.Gt, ast.GtE: sympy.Ge}
# Either/both of two conditions (`Eq(seq, Min(64, seq)) | Eq(Min(64, seq), 1)`, a broadcast's guard).
_LOGIC = {ast.BitOr: sympy.Or, ast.BitAnd: sympy.And}
_ASSUMPTIONS = frozenset(_assume_defined)


def _build(node: ast.AST, symbols: dict[str, sympy.Symbol], depth: int) -> sympy.Basic:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return sympy.Integer(node.value) if type(node.value) is int else sympy.Float(node.value)
    if isinstance(node, ast.Name):
        return symbols.setdefault(node.id, sympy.Symbol(node.id))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _build(node.left, symbols, depth + 1), _build(node.right, symbols, depth + 1)
        if isinstance(node.op, ast.Pow) and right.is_number and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.BinOp) and type(node.op) in _LOGIC:
        return _LOGIC[type(node.op)](_build(node.left, symbols, depth + 1), _build(node.right, symbols, depth + 1))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_build(node.operand, symbols, depth + 1))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        left, right = _build(node.left, symbols, depth + 1), _build(node.comparators[0], symbols, depth + 1)
        return _COMPARE[type(node.ops[0])](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_build(a, symbols, depth + 1) for a in node.args))
    raise ValueError(f"{ast.dump(node)[:80]} is not allowed (numbers, symbol names, arithmetic, comparisons, | and & of them, "
                     f"{', '.join(_FUNCTIONS)} only)")


def make_symbols(assumptions: object) -> dict[str, sympy.Symbol]:
    """Symbols from `{name: {assumption: bool}}` (e.g. torch's shape symbols: integer, positive)."""
    if not isinstance(assumptions, dict):
        raise ValueError("symbol assumptions must be a mapping of name to {assumption: bool}")
    symbols = {}
    for name, flags in assumptions.items():
        if not (isinstance(name, str) and name.isidentifier() and isinstance(flags, dict)
                and all(k in _ASSUMPTIONS and type(v) is bool for k, v in flags.items())):
            raise ValueError(f"bad assumptions for symbol {str(name)[:40]!r}: {str(flags)[:80]}")
        symbols[name] = sympy.Symbol(name, **flags)
    return symbols


def parse_sym(text: str, symbols: dict[str, sympy.Symbol]) -> sympy.Basic:
    """The sympy expression `text` spells; names not in `symbols` become plain symbols. ValueError otherwise."""
    if not isinstance(text, str) or len(text) > MAX_LENGTH:
        raise ValueError(f"a symbolic expression must be a string of at most {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
        return _build(tree.body, dict(symbols), 0)
    except (SyntaxError, ValueError, RecursionError, MemoryError, TypeError, ZeroDivisionError) as exc:
        raise ValueError(f"bad symbolic expression {text[:60]!r}: {exc}") from None
