"""`fleetc dump-ir --format html` and `--dir`: a self-contained report and one numbered file per pass."""
from __future__ import annotations

import json
import os
import re

import pytest

from fleetc.cli import main
from fleetc.ir.serialize import from_dict
from fleetc.passes.order import ordered_passes
from fleetc.strategy import resolve_strategy

STAGES = ["capture", *(p.name for p in ordered_passes(resolve_strategy(None)))]  # what the default strategy runs


def dump(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["dump-ir", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_html_report_is_one_self_contained_page_with_a_section_per_pass(capsys, tmp_path) -> None:
    target = tmp_path / "report.html"
    assert dump(capsys, "cli_factories:mlp", "--format", "html", "--out", str(target)) == (0, "", "")
    page = target.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and not re.search(r'(src|href)="(?!#)', page)  # nothing to fetch, no JS
    sections = re.findall(r'<section class="record" id="pass-(\d+)"><h3>#\d+ (\w+) ', page)
    assert [name for _, name in sections] == STAGES
    assert 'class="op r-forward removed"' in page  # remove_noop_views' section highlights what it removed
    assert "estimated live bytes after each op" in page
    assert os.listdir(tmp_path) == ["report.html"]


def test_html_after_one_pass_has_that_section_only(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--format", "html", "--after", "remove_noop_views")
    assert code == 0
    assert re.findall(r'<section class="record" id="pass-(\d+)"><h3>#\d+ (\w+) ', out) == [("1", "remove_noop_views")]


def test_dir_writes_one_numbered_file_per_pass(capsys, tmp_path) -> None:
    folder = tmp_path / "ir"
    folder.mkdir()
    (folder / "007_stale_pass.txt").write_text("from an earlier dump")
    (folder / "notes.md").write_text("mine")
    code, out, err = dump(capsys, "cli_factories:mlp", "--dir", str(folder))
    assert (code, err) == (0, "")
    names = [f"{i:03d}_{name}.txt" for i, name in enumerate(STAGES)]
    assert out.splitlines() == [str(folder / n) for n in names]
    assert sorted(os.listdir(folder)) == sorted([*names, "notes.md"])  # stale dump gone, other files kept
    first = (folder / names[1]).read_text()
    assert first.startswith("# after remove_noop_views: changed; ") and " ms" not in first.splitlines()[0]
    _, single, _ = dump(capsys, "cli_factories:mlp", "--after", "remove_noop_views")
    assert first.split("\n", 1)[1] == single  # the same listing dump-ir prints, so files diff like dumps
    dump(capsys, "cli_factories:mlp", "--dir", str(folder))
    assert (folder / names[1]).read_text() == first  # deterministic: a second run diffs clean


def test_dir_after_change_as_json_keeps_history_numbers(capsys, tmp_path) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--dir", str(tmp_path), "--format", "json", "--after-change")
    assert code == 0
    files = sorted(os.listdir(tmp_path))
    # On the single-process mlp only these change the Program; the data-parallel passes report "no collectives".
    changing = ("capture", "remove_noop_views", "dead_code_elimination")
    assert files == [f"{i:03d}_{name}.json" for i, name in enumerate(STAGES) if name in changing]
    entry = json.loads((tmp_path / files[1]).read_text())
    assert entry["pass"] == STAGES[1] and entry["report"]["changed"] is True
    assert "aten.detach.default" not in str(from_dict(entry["program"]))


def test_after_all_shows_each_pass_with_its_diff(capsys) -> None:
    code, out, _ = dump(capsys, "cli_factories:mlp", "--after", "all")
    assert code == 0
    for name in STAGES[1:]:
        assert f"# constructed by {name} (" in out
    for name in ("remove_noop_views", "dead_code_elimination"):  # the passes that change the mlp's Program
        assert f"--- before {name}\n+++ after {name}\n" in out
    assert re.search(r"^-  detach: f32\[16,64\] = aten\.detach\.default\(relu\)", out, re.M)


@pytest.mark.parametrize("argv, message", [
    (["--dir", "{tmp}/d", "--out", "{tmp}/x"], "--dir writes one text or json file per pass"),
    (["--dir", "{tmp}/d", "--format", "html"], "use it without --out and --format html"),
    (["--memory", "--format", "html"], "--memory applies to --format text only"),
    (["--dir", "{tmp}/file.txt/sub"], "cannot write to directory '{tmp}/file.txt/sub'"),
])
def test_bad_dump_options_give_one_line_and_exit_2(capsys, tmp_path, argv, message) -> None:
    (tmp_path / "file.txt").write_text("a file, not a folder")
    code, out, err = dump(capsys, "cli_factories:mlp", *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and out == ""
    assert err.startswith("fleetc dump-ir: error: ") and err.count("\n") == 1
    assert message.format(tmp=tmp_path) in err


def test_help_documents_html_and_dir(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["dump-ir", "--help"])
    text = capsys.readouterr().out
    assert "--dir DIR" in text and "000_capture.txt" in text and "self-contained" in text
