"""scripts/support_matrix.py loaded as a module, and the support matrix README.md records (architecture → preset →
"pass" or "fail: ..."), for the tests that check it and the tests that choose what to run from it."""
from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "scripts" / "support_matrix.py")
support_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(support_matrix)


def committed_table() -> str:
    """The support matrix as committed in README.md (markdown)."""
    return support_matrix.committed((ROOT / "README.md").read_text())


def recorded_cells() -> dict[str, dict[str, str]]:
    """README.md's support matrix, cell by cell."""
    return support_matrix.parse(committed_table())
