"""`fleetc dump-ir`, run in-process through `main`, plus one run of the real `python -m fleetc` entry point."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import sympy

import fleetc
from fleetc.cli import main
from fleetc.ir.serialize import from_dict, program_from_json
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_strategy

TESTS_DIR = pathlib.Path(__file__).resolve().parent
STAGES = ["capture", *(p.name for p in ordered_passes(resolve_strategy(None)))]  # what the default strategy runs


def dump(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["dump-ir", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_shows_every_section_after_the_last_pass(capsys) -> None:
    code, out, err = dump(capsys, "cli_factories:mlp")
    assert (code, err) == (0, "")
    assert out.startswith("program train: ")
    assert "# forward" in out and "# backward" in out
    assert "= fleetc.sgd(fc1.weight, " in out  # dump-ir's default SGD shows the optimize section
    assert "aten.detach.default" not in out  # remove_noop_views ran
    assert not out.startswith("# constructed by")


def test_json_output_round_trips_to_the_text_output(capsys) -> None:
    _, text, _ = dump(capsys, "cli_factories:mlp")
    code, out, _ = dump(capsys, "cli_factories:mlp", "--format", "json")
    assert code == 0
    assert str(program_from_json(out)) + "\n" == text


def test_after_named_pass_prints_that_program(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--after", "capture")
    assert code == 0
    assert out.startswith("program train: ") and "aten.detach.default" in out


def test_after_all_prints_one_header_per_record(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--after", "all")
    assert code == 0
    headers = [line for line in out.splitlines() if line.startswith("# constructed by ")]
    assert [h.split()[3] for h in headers] == STAGES
    assert out.count("\nprogram train: ") + out.startswith("program train: ") == len(STAGES)


def test_after_all_as_json_lists_every_pass(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--after", "all", "--format", "json")
    assert code == 0
    entries = json.loads(out)
    assert [e["pass"] for e in entries] == STAGES
    programs = [from_dict(e["program"]) for e in entries]
    assert programs[0].num_ops() > programs[-1].num_ops()


def test_after_change_prints_changed_passes_with_diffs(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--after-change")
    assert code == 0
    assert "--- before remove_noop_views\n+++ after remove_noop_views\n" in out
    assert re.search(r"^-  detach: f32\[16,64\] = aten\.detach\.default\(relu\)", out, re.M)
    assert "--- before capture" not in out  # capture has nothing before it to diff against


def test_disable_pass_keeps_what_the_pass_removes(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--disable-pass", "remove_noop_views", "--after", "all")
    assert code == 0
    assert "# constructed by remove_noop_views (0.0 ms): unchanged (disabled by the user" in out
    final = out.rpartition("# constructed by dead_code_elimination")[2]
    assert "aten.detach.default" in final


def test_memory_lists_live_bytes_per_op_and_the_peak(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--memory")
    assert code == 0
    num_ops = int(re.match(r"program train: (\d+) ops", out).group(1))
    rows = re.findall(r"^#   (\S+) +(\d+)$", out, re.M)
    assert len(rows) == num_ops and rows[0][0] == "t"
    peak = re.search(r"^# peak: (\d+) bytes \(\d+\.\d\d MiB\) after op (\S+)$", out, re.M)
    assert int(peak.group(1)) == max(int(b) for _, b in rows)
    assert peak.group(2) in {name for name, _ in rows}


def test_dynamic_memory_prints_the_peak_formula_in_the_dims(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--dynamic", "--memory")
    assert code == 0 and "x: f32[batch,32]" in out
    formula = re.search(r"^# peak formula: (.+) bytes \(the numbers above are for batch=(\d+)", out, re.M)
    assert formula and "batch" in formula.group(1)
    peak = int(re.search(r"^# peak: (\d+) bytes", out, re.M).group(1))
    assert int(sympy.sympify(formula.group(1)).subs("batch", int(formula.group(2)))) == peak


def test_out_writes_the_file_and_nothing_else(capsys, tmp_path) -> None:
    _, text, _ = dump(capsys, "cli_factories:mlp")
    target = tmp_path / "ir.txt"
    code, out, err = dump(capsys, "cli_factories:mlp", "--out", str(target))
    assert (code, out, err) == (0, "", "")
    assert target.read_text() == text
    assert os.listdir(tmp_path) == ["ir.txt"]  # no temporary file left beside it


def test_strategy_file_overrides_the_factory_strategy(capsys, tmp_path, monkeypatch) -> None:
    compiled = {}
    real_compile = fleetc.compile

    def spy(model, strategy=None, **kwargs):
        compiled["trainer"] = real_compile(model, strategy, **kwargs)
        return compiled["trainer"]

    monkeypatch.setattr(fleetc, "compile", spy)
    assert dump(capsys, "cli_factories:mlp_with_strategy")[0] == 0
    assert compiled["trainer"].config.amp is True and compiled["trainer"].verify is False
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps({"sync_batch_norm": True}))
    assert dump(capsys, "cli_factories:mlp_with_strategy", "--strategy", str(path), "--verify")[0] == 0
    trainer = compiled["trainer"]
    assert trainer.config.sync_batch_norm is True and trainer.config.amp is False
    assert trainer.verify is True


@pytest.mark.parametrize("argv, message", [
    (["cli_factories"], "factory 'cli_factories' must look like 'package.module:function'"),
    (["no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz': No module named 'no_such_module_xyz'"),
    (["cli_factories:mlpp"], "'cli_factories' has no attribute 'mlpp'; did you mean 'mlp'?"),
    (["cli_factories:not_callable"], "'cli_factories:not_callable' is not a callable factory (it is a int)"),
    (["cli_factories:returns_list"], "factory 'cli_factories:returns_list' returned list; expected a dict"),
    (["cli_factories:missing_args"], "factory 'cli_factories:missing_args' returned no 'args'"),
    (["cli_factories:misspelt_key"], "returned unknown key 'optimiser'; did you mean 'optimizer'?"),
    (["cli_factories:mlp", "--after", "dead_code_elimnation"],
     "unknown pass 'dead_code_elimnation' for --after; did you mean 'dead_code_elimination'?"),
    (["cli_factories:mlp", "--disable-pass", "remove_noop_view"],
     "unknown pass 'remove_noop_view' for --disable-pass; did you mean 'remove_noop_views'?"),
    (["cli_factories:mlp", "--strategy", "{tmp}/missing.json"], "cannot load strategy file '{tmp}/missing.json'"),
    (["cli_factories:mlp", "--strategy", "{tmp}/bad.json"], "did you mean 'recompute'?"),
    (["cli_factories:mlp", "--memory", "--format", "json"], "--memory applies to --format text only"),
    (["cli_factories:needs_arguments"], "factory 'cli_factories:needs_arguments' must take no arguments"),
    (["cli_factories:optimizer_as_a_string"], "'optimizer' is a str ('sgd'), not a torch.optim.Optimizer"),
    (["cli_factories:raises"], "factory 'cli_factories:raises' raised RuntimeError: the factory itself failed"),
    (["broken_factory_module:f"], "cannot import module 'broken_factory_module': syntax error at "),
    (["failing_factory_module:f"], "importing module 'failing_factory_module' raised ZeroDivisionError"),
])
def test_bad_input_gives_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message) -> None:
    (tmp_path / "bad.json").write_text('{"recompue": true}')
    (tmp_path / "broken_factory_module.py").write_text("def f(:\n    pass\n")
    (tmp_path / "failing_factory_module.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)  # dump-ir imports factories from the current directory, as `python -m` does
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    code, out, err = dump(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and out == ""
    assert err.startswith("fleetc dump-ir: error: ") and err.count("\n") == 1
    assert message.format(tmp=tmp_path) in err


def test_compile_failure_gives_its_message_and_exit_1(capsys) -> None:
    code, out, err = dump(capsys, "cli_factories:unsupported_optimizer")
    assert code == 1 and out == ""
    assert err.startswith("fleetc dump-ir: UnsupportedOptimizerError: LBFGS.step(closure) needs a closure ")
    assert err.count("\n") == 1


def test_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["dump-ir", "cli_factories:mlp", "--after", "all", "--after-change"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main([]) == 2
    assert "dump-ir" in capsys.readouterr().err


def test_help_documents_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["dump-ir", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--strategy", "--after", "--after-change", "--format", "--out", "--disable-pass", "--memory",
                   "--verify", "--dynamic", "package.module:function", "one real training step"):
        assert option in text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "dump-ir" in capsys.readouterr().out


def test_python_dash_m_entry_point_passes_the_exit_status() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR)])}
    run = subprocess.run([sys.executable, "-m", "fleetc", "dump-ir", "cli_factories:mlp", "--after", "nope"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("fleetc dump-ir: error: unknown pass 'nope' for --after")
    assert run.stderr.count("\n") == 1
