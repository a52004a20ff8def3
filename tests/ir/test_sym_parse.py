"""Symbolic shapes in serialized Programs are parsed, never evaluated: a file from someone else runs no code."""
from __future__ import annotations

import json

import pytest
import sympy

from fleetc.ir.program import Program, Var, VarKind
from fleetc.ir.serialize import program_from_json, program_to_json
from fleetc.ir.sym_parse import parse_sym

S0 = sympy.Symbol("s0", integer=True, positive=True)


@pytest.mark.parametrize("expr", [2 * S0 + 1, S0 ** 2, sympy.floor(S0 / 2), sympy.Mod(S0, 3), sympy.Max(S0, 7) - S0,
                                  sympy.ceiling(S0 / 4) * 4, -S0, 1 / S0])
def test_shape_expressions_round_trip(expr):
    program = Program()
    program.global_block.add_var(Var("x", (expr, 4), "float32", "cpu", VarKind.DATA))
    back = program_from_json(program_to_json(program))
    assert back.var("x").shape == (expr, 4)


def _payload_program(sym: str) -> str:
    program = Program()
    program.global_block.add_var(Var("x", (S0, 4), "float32", "cpu", VarKind.DATA))
    data = json.loads(program_to_json(program))
    data["blocks"][0]["vars"][0]["shape"][0]["$sym"] = sym
    return json.dumps(data)


@pytest.mark.parametrize("template", [
    "__import__('pathlib').Path({path!r}).write_text('pwned')",
    "s0 + __import__('pathlib').Path({path!r}).write_text('pwned')",
    "Max(s0, __import__('pathlib').Path({path!r}).write_text('pwned'))",
    "(lambda: __import__('pathlib').Path({path!r}).write_text('pwned'))()",
    "s0.__class__.__mro__[1].__subclasses__() and {path!r}",
])
def test_a_malicious_symbol_string_is_refused_without_running(template, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ValueError, match="bad symbolic expression"):
        program_from_json(_payload_program(template.format(path=str(marker))))
    assert not marker.exists()


@pytest.mark.parametrize("text", ["2**999999999", "s0" + " + s0" * 1000, "-" * 200 + "s0", "x[0]",
                                  "'s' * 3", "s0 if s0 else 1", "Symbol('t')"])
def test_expensive_or_unknown_forms_are_refused(text):
    with pytest.raises(ValueError):
        parse_sym(text, {"s0": S0})


def test_bad_assumptions_are_refused():
    program = json.loads(_payload_program("s0"))
    program["blocks"][0]["vars"][0]["shape"][0]["assumptions"] = {"s0": {"__class__": True}}
    with pytest.raises(ValueError, match="bad assumptions"):
        program_from_json(json.dumps(program))


@pytest.mark.parametrize("text", ["Eq(s0, Min(64, s0)) | Eq(Min(64, s0), 1)", "(s0 <= 8) & Ne(s0, 1)"])
def test_a_guard_of_either_or_both_conditions_parses_to_the_same_condition(text):
    expr = parse_sym(text, {"s0": S0})
    assert isinstance(expr, (sympy.Or, sympy.And)) and str(expr) == str(sympy.sympify(text, {"s0": S0}))
    assert [bool(expr.subs(S0, n)) for n in (1, 2, 64, 65)] == [eval(text, {  # noqa: S307 - a test's own text
        "Eq": lambda a, b: a == b, "Ne": lambda a, b: a != b, "Min": min, "s0": n}) for n in (1, 2, 64, 65)]
