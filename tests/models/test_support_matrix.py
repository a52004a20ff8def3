"""README.md's support matrix is what scripts/support_matrix.py writes, and `--check` tells when it is stale.

Cheap checks always run: the committed table parses back into every architecture × preset in the script's own
layout, and `stale_rows` reports a changed cell. A fresh run of one architecture's row (rotating daily) is checked
against the committed row; `FLEETC_FULL=1` checks every row.
"""
from __future__ import annotations

import datetime
import os

import pytest
from factories import ARCHITECTURES
from helpers.support_matrix import committed_table, support_matrix

from fleetc.fleet.explain import PRESETS

FULL = bool(os.environ.get("FLEETC_FULL"))
_NAMES = sorted(ARCHITECTURES)
CHECKED = _NAMES if FULL else [_NAMES[(datetime.date.today().toordinal() + 3) % len(_NAMES)]]


@pytest.fixture(scope="module")
def committed() -> str:
    return committed_table()


def test_committed_table_is_the_scripts_own_output(committed):
    cells = support_matrix.parse(committed)
    assert list(cells) == list(ARCHITECTURES)
    assert all(list(row) == list(PRESETS) for row in cells.values())
    assert support_matrix.table(cells) == committed


def test_check_reports_a_changed_cell(committed):
    cells = support_matrix.parse(committed)
    assert support_matrix.stale_rows(committed, cells) == []
    name = next(iter(cells))
    fresh = {name: {**cells[name], "fusion": "fail: something | new"}}  # a partial run: only its row is compared
    diff = "".join(support_matrix.stale_rows(committed, fresh))
    assert f"-| {name} | " in diff and "+| " + name in diff and "fail: something \\| new" in diff
    assert sum(line.startswith(("-|", "+|")) for line in diff.splitlines()) == 2


def test_a_partial_run_replaces_its_rows_only(committed):
    cells = support_matrix.parse(committed)
    name = list(cells)[1]
    fresh = {name: {**cells[name], "amp_bf16": "fail: other"}}
    merged = support_matrix.merged_rows(committed, fresh)
    assert list(merged) == list(ARCHITECTURES)
    assert merged == {**cells, **fresh}
    assert support_matrix.merged_rows(committed, cells) == cells  # a full run replaces every row


def test_a_hand_edited_table_is_refused(committed):
    lines = committed.splitlines()
    with pytest.raises(SystemExit, match="line 3 of the support matrix"):
        support_matrix.parse("\n".join([*lines[:2], lines[2].rsplit(" | ", 1)[0] + " |", *lines[3:]]))
    with pytest.raises(SystemExit, match="header"):
        support_matrix.parse("\n".join(lines[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED)
def test_a_fresh_run_matches_the_committed_row(name, capsys):
    status = support_matrix.main(["--check", "--only", name])
    assert status == 0, capsys.readouterr().out
