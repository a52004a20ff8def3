"""Before/after pass fixtures: each file in fixtures/<family>/ runs one pass on a small Program and pins the result.

A fixture file (docs/ir.md, "Pass fixtures"):

    // What the fixture pins, in a sentence or two.
    // pass: fuse_elewise_add_act
    // strategy: build_strategy.fuse_elewise_add_act_ops = True
    // grad_clip: ClipGradByGlobalNorm(1.0)      (optional: fleetc.compile's grad_clip, for the grad_clip pass)
    // ----- input
    program train: …            (the Program the pass gets, in printed form)
    // ----- expected: changed; add_act_fused=1
    program train: …            (the Program it must leave)

The pass is taken from the pass order for the strategy (so the flag must really switch it on) and runs under the
verifier. A mismatch fails with a unified diff; FLEETC_UPDATE_FIXTURES=1 rewrites the expected section (and the
input into printed form) and reports each rewritten file as skipped, so regeneration is deliberate and visible.
"""
from __future__ import annotations

import ast
import difflib
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

import fleetc
from fleetc.ir.liveness import estimate_memory
from fleetc.ir.program import Program
from fleetc.ir.verifier import verify
from fleetc.passes.base import PassReport
from fleetc.passes.instruments import VerifyInstrument
from fleetc.passes.manager import History, PassManager, PassRecord
from fleetc.passes.order import all_pass_names, ordered_passes
from fleetc.strategy import resolve_conflicts
from fleetc.strategy.config import StrategyConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
UPDATE = os.environ.get("FLEETC_UPDATE_FIXTURES") == "1"
INPUT = "// ----- input"
EXPECTED = "// ----- expected"
_FIELD = re.compile(r"// (pass|strategy|grad_clip): (.*)")
_CLIPS = {"ClipGradByGlobalNorm": fleetc.ClipGradByGlobalNorm, "ClipGradByNorm": fleetc.ClipGradByNorm,
          "ClipGradByValue": fleetc.ClipGradByValue}


@dataclass
class Fixture:
    """One fixture file, split into its parts."""

    path: pathlib.Path
    preamble: list[str]  # the description and the pass/strategy lines, as written
    pass_name: str = ""
    strategy: dict = field(default_factory=dict)
    grad_clip: Any = None
    input_text: str = ""
    expected_report: str = ""
    expected_text: str = ""

    @classmethod
    def read(cls, path: pathlib.Path) -> Fixture:
        text = path.read_text()
        if INPUT not in text or EXPECTED not in text:
            raise AssertionError(f"{path}: a fixture needs a '{INPUT}' line and a '{EXPECTED}' line")
        head, rest = text.split(INPUT + "\n", 1)
        input_text, expected = rest.split(EXPECTED, 1)
        report_line, _, expected_text = expected.partition("\n")
        fixture = cls(path, head.splitlines(), input_text=input_text.strip("\n"),
                      expected_report=report_line.removeprefix(":").strip(), expected_text=expected_text.strip("\n"))
        for line_no, line in enumerate(fixture.preamble, 1):
            found = _FIELD.fullmatch(line)
            if found and found.group(1) == "pass":
                fixture.pass_name = found.group(2).strip()
            elif found and found.group(1) == "grad_clip":
                fixture.grad_clip = _clip(found.group(2), f"{path}:{line_no}")
            elif found:
                key, _, value = found.group(2).partition(" = ")
                try:
                    fixture.strategy[key.strip()] = ast.literal_eval(value.strip())
                except (ValueError, SyntaxError) as exc:
                    raise AssertionError(f"{path}:{line_no}: expected 'strategy: FIELD = PYTHON_LITERAL'") from exc
        if not fixture.pass_name:
            raise AssertionError(f"{path}: no '// pass: NAME' line before '{INPUT}'")
        return fixture

    def write(self, input_text: str, report: str, expected_text: str) -> None:
        self.path.write_text("\n".join([*self.preamble, INPUT, input_text, f"{EXPECTED}: {report}",
                                        expected_text]) + "\n")


def _clip(text: str, where: str) -> Any:
    """`ClipGradByNorm(0.5)`: one of fleetc's clip classes with literal arguments (nothing else is evaluated)."""
    call = ast.parse(text.strip(), mode="eval").body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _CLIPS):
        raise AssertionError(f"{where}: expected 'grad_clip: <{' | '.join(_CLIPS)}>(literal arguments)'")
    return _CLIPS[call.func.id](*(ast.literal_eval(a) for a in call.args),
                                **{k.arg: ast.literal_eval(k.value) for k in call.keywords})


def fixture_paths() -> list[pathlib.Path]:
    return sorted(FIXTURES.glob("*/*.txt"))


def run_fixture(fixture: Fixture) -> tuple[Program, PassReport]:
    """The fixture's pass, as the pass order builds it for the fixture's strategy, run under the verifier."""
    program = Program.parse(fixture.input_text)
    verify(program)
    config, _ = resolve_conflicts(StrategyConfig(fixture.strategy, explicit_fields=fixture.strategy))
    passes = {p.name: p for p in ordered_passes(config, grad_clip=fixture.grad_clip)}
    if fixture.pass_name not in passes:
        raise AssertionError(f"{fixture.path}: pass {fixture.pass_name!r} is not in the pass order for strategy "
                             f"{fixture.strategy}; the order has {list(passes)}")
    history = History([PassRecord("input", program, PassReport("input"), 0.0, estimate_memory(program))])
    result = PassManager([passes[fixture.pass_name]], [VerifyInstrument()]).run(program, config, history)
    return result, history[-1].report


def _diff(expected: str, actual: str, what: str) -> str:
    lines = difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), f"{what} (fixture)",
                                 f"{what} (actual)")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_pass_fixture(path: pathlib.Path) -> None:
    fixture = Fixture.read(path)
    canonical_input = str(Program.parse(fixture.input_text))
    result, report = run_fixture(fixture)
    actual, actual_report = str(result), report.summary()
    matches = (canonical_input, actual_report, actual) == (fixture.input_text, fixture.expected_report,
                                                           fixture.expected_text)
    if UPDATE and not matches:
        fixture.write(canonical_input, actual_report, actual)
        pytest.skip(f"rewrote {path} (FLEETC_UPDATE_FIXTURES=1): review it with git diff")
    assert canonical_input == fixture.input_text, (
        f"{path}: the input is not in printed form (rerun with FLEETC_UPDATE_FIXTURES=1 to rewrite it):\n"
        + _diff(fixture.input_text, canonical_input, "input"))
    assert actual_report == fixture.expected_report, (
        f"{path}: the pass report differs: expected {fixture.expected_report!r}, got {actual_report!r}")
    assert actual == fixture.expected_text, (
        f"{path}: {fixture.pass_name} left a different Program (FLEETC_UPDATE_FIXTURES=1 rewrites the expected "
        "output; review the change with git diff):\n" + _diff(fixture.expected_text, actual, "expected"))


def test_every_pass_has_a_fixture_and_every_family_three() -> None:
    fixtures = [Fixture.read(p) for p in fixture_paths()]
    assert {f.pass_name for f in fixtures} >= set(all_pass_names()), "passes without a fixture"
    families = {p.parent.name for p in fixture_paths()}
    assert families >= {"cleanup", "precision", "recompute", "fusion", "gradient_merge", "data_parallel",
                        "optimizers"}
    for family in families:
        assert len(list((FIXTURES / family).glob("*.txt"))) >= 3, family
