"""`fleetc export`: a factory's model saved for inference; bad input is one line on stderr and exit status 2."""
from __future__ import annotations

import json

import cli_factories
import pytest
import torch

from fleetc.cli import main
from fleetc.fleet.inference import META_FILE, MODEL_FILE


def export(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["export", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_writes_the_model_and_prints_the_files(capsys, tmp_path):
    code, out, err = export(capsys, "cli_factories:mlp", "--out", str(tmp_path / "m"))
    assert (code, err) == (0, "")
    assert out.splitlines() == [str(tmp_path / "m" / MODEL_FILE), str(tmp_path / "m" / META_FILE)]
    spec = cli_factories.mlp()  # the same seed: the same weights, untrained (export trains nothing)
    x = spec["args"][0]
    module = torch.export.load(str(tmp_path / "m" / MODEL_FILE)).module()
    spec["model"].eval()
    torch.testing.assert_close(module(x), spec["model"](x).detach())
    meta = json.loads((tmp_path / "m" / META_FILE).read_text())
    assert [i["name"] for i in meta["inputs"]] == ["x"] and meta["inputs"][0]["shape"] == ["batch", 32]


def test_targets_prune_and_notes_go_to_stderr(capsys, tmp_path):
    code, _, err = export(capsys, "cli_factories:gpt", "--out", str(tmp_path / "g"), "--target", "layers.0")
    assert code == 0 and err.startswith("fleetc export: note: the batch dimension is exported static (size 4)")
    meta = json.loads((tmp_path / "g" / META_FILE).read_text())
    assert [o["name"] for o in meta["outputs"]] == ["layers.0"]
    assert meta["ops"]["exported"] < meta["ops"]["eval_program"]
    code, _, _ = export(capsys, "cli_factories:mlp", "--out", str(tmp_path / "n"), "--target", "fc1", "--no-prune")
    assert code == 0 and json.loads((tmp_path / "n" / META_FILE).read_text())["ops"]["exported"] == 8


@pytest.mark.parametrize("argv, message", [
    (["cli_factories:gpt", "--feed", "ids"], "'ids' is not an argument of TinyGPT.forward; did you mean 'idx'?"),
    (["cli_factories:mlp", "--target", "fc4"], "'fc4' names no output, module or value of the eval Program"),
    (["cli_factories:mlp", "--out", "/proc/no/such"], "cannot write the inference model to '/proc/no/such'"),
    (["cli_factories:nope"], "'cli_factories' has no attribute 'nope'"),
    (["cli_factories:missing_args"], "returned no 'args'"),
])
def test_bad_input_is_one_line_and_exit_status_2(capsys, tmp_path, argv, message):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "m")]
    code, out, err = export(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("fleetc export: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "m").exists()
